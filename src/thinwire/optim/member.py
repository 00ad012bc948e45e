"""One parameter of an optimizer's layout (`Member`): the floor below the step envelope
(`optim/base.py`), its hooks and its checkpoints, which all speak of members."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Member(NamedTuple):
    """One parameter of the layout. `param` is what the algorithm computes on: the parameter
    itself, or under FSDP2 this rank's shard of it (a plain tensor sharing its storage, with
    `.grad` this rank's shard of the gradient; `thinwire.optim.shards`). `key` is the
    parameter as the param group holds it: `self.state[key]`."""
    group: dict
    param: torch.Tensor
    key: torch.Tensor
