"""DeMo's message layout, kept while the layout stays: each member's place in the message
(`Slot`) and the description every rank must share (`KeptSlots.describe`).

A step asks for both several times, and each member's payload size costs the host
microseconds: at GPT-2 small's 148 tensors that was ~1,000 payload sizes a step before
they were kept. Kept means: made again only when the tensors, their shape, dtype and device,
their compressor, the world size or a wire setting change.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..compress import ChunkedTopK
from .member import Member
from .flat import spans

WIRE_KEYS = ("topk", "chunk", "transform", "values", "seed", "aggregate", "base", "momentum_domain", "momentum_form")


class Slot(NamedTuple):
    """One parameter's place in the message: its group, tensor, compressor and byte range."""
    group: dict
    param: torch.Tensor
    comp: ChunkedTopK
    offset: int
    nbytes: int
    key: torch.Tensor                 # the parameter itself (param: its shard under FSDP2)


class KeptSlots:
    """The slots of the last layout asked for, and their description."""

    def __init__(self):
        self._slots: tuple | None = None          # (the layout's key, its slots, the layout object)
        self._described: tuple | None = None      # (slots, settings, the text)

    def slots(self, layout: list[Member], compressor: Callable[[dict], ChunkedTopK]) -> list[Slot]:
        if self._slots is not None and self._slots[2] is layout:     # asked again within a step
            return self._slots[1]
        comps = [compressor(m.group) for m in layout]
        key = tuple((id(m.key), id(m.param), id(m.group), id(comp), m.param.shape, m.param.dtype, m.param.device)
                    for m, comp in zip(layout, comps))
        if self._slots is None or self._slots[0] != key:             # the slots hold the ids' objects alive
            places = spans(comp.payload_nbytes(m.param.shape) for m, comp in zip(layout, comps))
            self._slots = (key, [Slot(group, p, comp, place.start, place.size, k)
                                 for (group, p, k), comp, place in zip(layout, comps, places)], layout)
        self._slots = (*self._slots[:2], layout)
        return self._slots[1]

    def describe(self, slots: list[Slot], world_size: int, param_groups: list[dict]) -> str:
        key = (world_size, tuple(tuple(g.get(k) for k in WIRE_KEYS) for g in param_groups))
        if self._described is None or self._described[0] is not slots or self._described[1] != key:
            lines = [f"demo world_size={world_size}"]
            for group, p, _, offset, n, _ in slots:
                wire = ",".join(f"{k}={group[k]}" for k in WIRE_KEYS)
                lines.append(f"{tuple(p.shape)} {p.dtype} {wire} @{offset}+{n}")
            self._described = (slots, key, "\n".join(lines))
        return self._described[2]
