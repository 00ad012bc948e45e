"""DeMo's landing: the gathered messages decoded and checked on the device, then aggregated,
transformed back and applied, θ ← θ(1 − ηλ) − η φ(T⁻¹(aggregate)), groups first
(`demo_groups`), then the parameters on the per-tensor path (`demo_tensor`)."""

from __future__ import annotations

import torch

from ..compress import Payload
from . import demo_groups
from .demo_groups import Groups
from .demo_rules import step_param
from .demo_slots import Slot
from .median_clip import clip_chunks, clip_reads


def decode(groups: Groups, slots: list[Slot], gathered: torch.Tensor, present: list) -> tuple:
    """The payload rows of `gathered` [ranks, payload bytes] decoded: (per group (positions,
    values), per per-tensor parameter its ranks' reads, the device flags of malformed payloads)."""
    world = gathered.shape[0]
    flat = gathered.reshape(-1) if groups.groups else None          # [W · nbytes]: a copy if strided
    decoded = [g.chunks.received(flat, world) for g in groups.groups]
    reads, flags = {}, [f for _, _, fs in decoded for f in fs]
    for i in groups.rest:
        group, p, comp, offset, n, key = slots[i]
        if present[i]:
            spec = comp.payload_spec(p.shape)
            got = [comp.read_flagged(Payload.from_buffer(gathered[r, offset: offset + n], spec), p.shape)
                   for r in range(world)]                               # rank order
            reads[i] = [read for read, _ in got]
            flags += [f for _, fs in got for f in fs]
    return [(positions, values) for positions, values, _ in decoded], reads, flags


def land(groups: Groups, slots: list[Slot], decoded: tuple, scratch: tuple[torch.Tensor, torch.Tensor], step: int,
         clip: str | None, present: list, skip: torch.Tensor | None = None) -> None:
    """`decode`'s answer applied: each group's (and per-tensor parameter's) aggregate of its
    senders (each clipped to the median norm with `clip`), transformed back, stepped into θ;
    `skip` (0-dim bool on the device): where set, no θ moves."""
    a, b = scratch
    received, reads, _ = decoded
    for g, (positions, values) in zip(groups.groups, received):
        if clip and values.shape[0] > 1:                # each sender's tensors to the median norm (1 row: × 1)
            values = clip_chunks(values, g.chunk_tensor, g.chunk_counts)
        delta = demo_groups.aggregate(g, positions, values, out=a, counts=b)
        g.chunks.inverse(delta, step, scratch=b)
        demo_groups.step_params(g, slots, delta, present, skip)
    for i, read in reads.items():                       # none under `skip` (`_applies_masked`)
        group, p, comp, _, _, key = slots[i]
        read = clip_reads(read) if clip and len(read) > 1 else read
        step_param(p, comp.aggregate(read, p.shape, step, group["aggregate"], out=a, scratch=b), group, key)
