"""The debug switch for checks that only catch thinwire's own bugs, and device-side status
flags for checks of what arrived from peers.

Two kinds of check guard the wire:
- **Our own values** (a packer handed integers wider than its width, a top-k index past its
  chunk): only a bug in thinwire can make them fail, and reading the answer on the host
  makes a GPU wait for every kernel queued before it. They run only when the environment
  variable `THINWIRE_DEBUG_CHECKS=1` is set when thinwire is imported (`enabled()`; tests
  turn it on with `set_enabled`).
- **What arrived from peers** (non-finite values, indices past their chunk): a peer's bug or
  a corrupted message can make them fail, so they always run, but on the device: each
  returns a 0-dim bool tensor (True: malformed) that the caller folds into one status per
  step (`any_of`) and reads once, after the whole message is decoded.
"""

from __future__ import annotations

import os

import torch

ENV = "THINWIRE_DEBUG_CHECKS"
_enabled = os.environ.get(ENV, "") == "1"        # read once, at import


def enabled() -> bool:
    """Whether checks of thinwire's own values run (THINWIRE_DEBUG_CHECKS=1 at import)."""
    return _enabled


def set_enabled(on: bool) -> bool:
    """Turn the debug checks on or off (tests); returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def nonfinite(values: torch.Tensor) -> torch.Tensor:
    """0-dim bool on the device: some value is NaN or ±inf."""
    gap = values - values                   # NaN exactly where a value is NaN or ±inf, else 0
    return gap.ne_(gap).any()               # three launches where isfinite() takes four and not one


def out_of_range(idx: torch.Tensor, n: int) -> torch.Tensor:
    """0-dim bool on the device: some index of idx (non-negative integers) is >= n."""
    return (idx >= n).any()


def any_of(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """One 0-dim bool, True when any of `flags` is (None when there are none)."""
    if not flags:
        return None
    return torch.stack(flags).any() if len(flags) > 1 else flags[0]
