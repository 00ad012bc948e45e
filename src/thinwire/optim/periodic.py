"""Periodic synchronisation, what DiLoCo, SparseLoCo and LoRDO share (`PeriodicAveraging`):
local steps, and every `sync_every`-th step a sync inside the step envelope
(`thinwire.optim.base`), made by the sync rule the optimizer composes (`self.sync`, a
`SyncRule`). On every rank, with θ₀ the parameters all ranks agreed on at the last sync (the
anchor, 'anchor' in self.state[p], created here):

    θ ← local step(θ)           every step (the algorithm's `_local_step`): local gradients,
                                no communication
    θ₀ ← sync(θ₀, θ);  θ ← θ₀   every H-th step, after its local step: the rule's message, one
                                exchange, and its outer step; every rank leaves the sync on the
                                same θ₀ (bit-identical replicas at delay 1)

The rules: `DenseMean` (`thinwire.optim.dense_mean`: Δ̄ = mean_ranks (θ − θ₀) and an outer
Nesterov step, its wire formats and error feedback; DiLoCo, LoRDO) and `SparseTopKSync`
(`thinwire.optim.sparseloco_sync`: the top-k of a decayed error feedback; SparseLoCo).
Nothing crosses the wire on local steps, so the cost per step is the sync's over H.

Non-finite gradients (`nonfinite`, the envelope's policy): a rank whose gradients are not
finite skips its local step. At a sync, every rank sees the flag (that step's, or one a
'raise' rank carried from a local step) and raises NonFiniteGradientError ('raise') or
skips the sync ('skip'); either way the sync is not made on any rank: anchors and the rule's
state (outer momenta, error feedback; LoRDO's bases) are unchanged, the healthy ranks keep
that step's local step as on any local step, and the replicas next meet at the following sync.

Overlap (`overlap=True`): a sync's exchange leaves at its step and is applied at the start of
the next `step()` (θ₀ ← outer(θ₀, ·); θ ← θ₀), before that step's local update, which uses
the gradient the caller took at the pre-sync parameters: streaming DiLoCo's delayed outer
step with a delay of one step. Nothing is discarded and no correction is needed: the one
local step taken across the delay is the next step's, applied after the sync (torchft's
delay instead restores the pre-sync parameters and drops the local steps made meanwhile).

Delay (`delay=τ`, 1 ≤ τ ≤ H, with overlap): the sync of step s stays in flight across the
local steps s + 1 ... s + τ − 1 and lands at the start of step s + τ, before its local update
(τ = 1: the overlap above; τ = H: it lands just before the next sync leaves, a round later,
streaming DiLoCo's overlap of a whole round). θ₀ and the rule's state move as above; each
replica keeps what it did meanwhile, measured from θ_s (its parameters at step s, kept here):

    θ ← θ₀ + (θ − θ_s)                              instead of θ ← θ₀ (the same when τ = 1)

so the next sync's Δ is exactly the local steps since step s. Every rank's θ₀ is bit-identical
after a landing; the replicas differ by their own local steps, as they do between syncs. A
checkpoint taken meanwhile keeps θ_s with the sync in flight; `flush()` lands it at once.

Two tiers (FSDP2 shards, `process_group` = the group across sites): θ₀, the rule's message and
outer step run on this rank's shard, exchanged with the ranks holding it in the other sites.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import CommunicatingOptimizer, Member
from .flat import Span, reuse, spans
from .sync_rule import SyncRule


class Slot(NamedTuple):
    """One parameter's place in the flat delta: its group, tensor and element range."""
    group: dict
    param: torch.Tensor
    span: Span
    key: torch.Tensor                 # the parameter itself (param: its shard under FSDP2)


def slots_of(layout: list[Member]) -> list[Slot]:
    places = spans(m.param.numel() for m in layout)
    return [Slot(group, p, place, key) for (group, p, key), place in zip(layout, places)]


def check_sync_every(sync_every) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    return sync_every


def check_delay(delay, sync_every, overlap) -> int:
    if isinstance(delay, bool) or not isinstance(delay, int) or not 1 <= delay <= sync_every:
        raise ValueError(f"delay must be an integer in [1, sync_every = {sync_every}], got {delay!r}")
    if delay > 1 and overlap is not True:
        raise ValueError(f"delay={delay} keeps a sync in flight across local steps: it needs overlap=True")
    return delay


def of_sync(name: str) -> property:
    """The sync rule's setting `name`, read on the optimizer (`opt.outer_lr`; the harness and
    tests read them there)."""
    return property(lambda self: getattr(self.sync, name), doc=f"The sync rule's `{name}`.")


class PeriodicAveraging(CommunicatingOptimizer):
    """Local steps, and every `sync_every`-th step the sync of `self.sync` (the module
    docstring). A subclass supplies `_local_step(step, layout)` (the inner update of every
    parameter with a gradient) and optionally `_after_sync(slot, mean_delta)` (called by
    `DenseMean`) and `_describe_param(group, p)`; it calls `_init_sync(...)` after torch's
    __init__. State per parameter, in self.state[p]: 'anchor' θ₀ (p's dtype and shape,
    contiguous), then the rule's.
    """

    kind = "periodic-averaging"
    REPLICAS_DRIFT = True                     # local steps between syncs

    def _init_sync(self, process_group, nonfinite: str, sync_every: int, sync: SyncRule,
                   overlap: bool = False, delay: int = 1) -> None:
        self.sync_every = check_sync_every(sync_every)
        self.delay = check_delay(delay, sync_every, overlap)
        self.sync = sync
        self._init_comm(process_group, nonfinite, overlap)
        sync.connect(self.comm)
        self._launched = None               # delay > 1: θ at the sync's step (float32, flat) until it lands

    # ---- what the algorithm adds ---------------------------------------------------------
    def _local_step(self, step: int, layout: list[Member]) -> None:
        raise NotImplementedError

    def _after_sync(self, slot: Slot, mean_delta: torch.Tensor) -> None:
        """After θ ← θ₀ at a sync, with this parameter's Δ̄ (flat float32) (default: nothing)."""

    def _has_after_sync(self) -> bool:
        return type(self)._after_sync is not PeriodicAveraging._after_sync

    def _describe_param(self, group: dict, p: torch.Tensor) -> str:
        return ""

    # ---- the delayed landing (delay > 1) ---------------------------------------------------
    def _elastic_fold(self, state: dict, record: dict, refuse: str) -> dict:
        return state                 # the sync not made: Δ_i stays in the replica, the next sync carries it

    def _landing_step(self, record) -> int:
        return record.step + self.delay

    def _launch(self, layout: list[Member]) -> None:
        """delay > 1: θ_s, every replica parameter at its sync's step, kept until that sync lands."""
        if self.delay == 1:
            return
        n = sum(m.param.numel() for m in layout)
        self._launched = reuse(self._launched, n, torch.float32, layout[0].param.device)
        places = spans(m.param.numel() for m in layout)
        torch._foreach_copy_([span.of(self._launched).view(m.param.shape) for m, span in zip(layout, places)],
                             [m.param for m in layout])

    def _rejoin_all(self, slots: list[Slot], skip: torch.Tensor | None = None) -> None:
        """`_rejoin` of every parameter, grouped where the arithmetic stays the same. `skip`
        (delay 1): θ stays where it is set (lerp's weight 0 or 1 gives θ or θ₀ exactly)."""
        params, anchors = [s.param for s in slots], [self.state[s.key]["anchor"] for s in slots]
        if self.delay == 1 and skip is not None:
            # θ ← lerp(θ, θ₀, keep): exactly θ₀ (keep 1) or θ (keep 0). A 0-dim tensor weight would be
            # read on the host; expanded per tensor it is not (on CUDA that takes foreach's per-tensor
            # path: a launch per parameter at a sync, no read)
            keep = skip.logical_not()
            by_dtype = {dtype: keep.to(dtype) for dtype in {p.dtype for p in params}}
            torch._foreach_lerp_(params, anchors, [by_dtype[p.dtype].expand_as(p) for p in params])
            return
        if self.delay == 1:
            torch._foreach_copy_(params, anchors)               # θ ← θ₀
            return
        fp32 = [i for i, p in enumerate(params) if p.dtype == torch.float32]
        if fp32:                                                # θ − θ_s, then θ₀ + (θ − θ_s), in place
            torch._foreach_sub_([params[i] for i in fp32],
                                [slots[i].span.of(self._launched).view(params[i].shape) for i in fp32])
            torch._foreach_add_([params[i] for i in fp32], [anchors[i] for i in fp32])
        for slot, p, anchor in zip(slots, params, anchors):
            if p.dtype != torch.float32:
                self._rejoin(p, anchor, slot.span)

    def _rejoin(self, p: torch.Tensor, anchor: torch.Tensor, span: Span) -> None:
        """θ ← θ₀: the replica joins the new anchor, keeping (delay > 1) the local steps it made
        while the sync was in flight: θ ← θ₀ + (θ − θ_s) (θ₀ itself when it made none)."""
        if self.delay == 1:
            p.copy_(anchor)
            return
        local = span.of(self._launched).view(p.shape)
        if p.dtype == torch.float32:
            # θ − θ_s, then θ₀ + (θ − θ_s), in place
            p.sub_(local).add_(anchor)
            return
        # θ − θ_s, then θ₀ + (θ − θ_s), in float32, rounded once to p's dtype
        p.copy_(local.neg_().add_(p).add_(anchor))

    def _pending_launch(self) -> dict:
        return {} if self._launched is None else {"launched": self._launched.clone()}

    def _load_pending_launch(self, record, saved: dict) -> None:
        if "launched" in saved:
            self._launched = saved["launched"].to(record.layout[0].param.device).clone()

    # ---- the envelope's hooks: the anchor here, the rest the rule's ------------------------
    def _describe(self, layout: list[Member]) -> str:
        lines = [f"{self.kind} world_size={self.comm.world_size} K={self.sync_every} {self.sync.describe(self.delay)}"]
        lines += [f"{tuple(p.shape)} {p.dtype} {self._describe_param(g, p)}".rstrip() for g, p, _ in layout]
        return "\n".join(lines)

    def _presence(self, layout: list[Member]) -> list[bool]:
        """Every parameter has a delta to send, gradient or not."""
        return [True] * len(layout)

    def _exchange(self, step: int, layout: list[Member]):
        if step % self.sync_every or not layout:
            return None                                             # a local step
        return self.sync.exchange(layout)

    def _prepare(self, step: int, layout: list[Member]) -> None:
        for _, p, key in layout:
            state = self.state[key]
            if "anchor" not in state:                               # θ₀: the parameters before the first step
                state["anchor"] = p.detach().clone(memory_format=torch.contiguous_format)
            elif not state["anchor"].is_contiguous():               # a loaded one, whatever its strides
                state["anchor"] = state["anchor"].contiguous()
        self.sync.prepare(self, layout)

    def _encode(self, step: int, layout: list[Member], exchange) -> None:
        """The local step; at a sync, then the rule's message (`SyncRule.encode`)."""
        if exchange is not None:
            self.sync.check(self, layout)                           # before anything moves or is sent
        self._local_step(step, layout)
        if exchange is not None:
            self.sync.encode(self, step, layout, exchange)

    def _arrival(self, step: int, layout: list[Member], delivery) -> list[torch.Tensor]:
        return self.sync.arrival(self, step, layout, delivery)

    def _apply(self, step: int, layout: list[Member], delivery, skip: torch.Tensor | None = None) -> None:
        self.sync.apply(self, step, layout, delivery, skip)

    def _applies_masked(self, layout: list[Member]) -> bool:
        """nonfinite='skip': a sync the rule lands under the device's verdict, with no host read
        (`thinwire.optim.verdict`), unless a subclass adds to the landing."""
        return (type(self)._apply is PeriodicAveraging._apply and not self._has_after_sync()
                and self.sync.applies_masked(self))

    def _apply_masked(self, step: int, layout: list[Member], delivery, skip: torch.Tensor) -> None:
        self.sync.apply_masked(self, step, layout, delivery, skip)

    def _discard(self, step: int, layout: list[Member], exchange) -> None:
        self.sync.discard(self, step, layout, exchange)

    def _pending_state(self, record) -> dict:
        """A checkpoint with a sync in flight keeps θ_s (delay > 1) and what the rule's apply commits."""
        return {**self._pending_launch(), **self.sync.pending()}

    def _load_pending_state(self, record, saved: dict) -> None:
        self._load_pending_launch(record, saved)
        self.sync.load_pending(self, record, saved)
