"""SparseTopKSync: SparseLoCo's sync rule (`thinwire.optim.sync_rule`), the equations of
`thinwire.optim.sparseloco` (its module docstring) from Δ on, at a sync after the local step:

    Δ = θ₀ − θ;  e = β e + Δ;  Δ̂_r = Q(TopK(e))     `encode`: the message
    e' = e − Δ̂_r                                     `encode`: kept aside until the landing
    θ ← θ₀ − c α Δ̂_r                                 `encode`: the eager jump (delay > 1)
    Δ̄ = (1/R) Σ_r Δ̂_r;  e ← e'                       `apply`, at the landing
    θ₀ ← θ₀ − α Δ̄;  θ ← θ₀ (+ θ − θ_s)               `apply`

on the grouped layout (`thinwire.optim.sparseloco_groups`, `grouped = True`, the default) or
tensor by tensor (`grouped = False`, the reference: `FlatSparseLoCo`, each parameter's Δ, e
and |e|, one top-k per group, each parameter's values, e' and eager jump while it is in cache,
the packing and, at the landing, the reading batched over parameters of one chunk shape).
A sync made on no rank undoes the jump (`discard`); a message that missed a store round goes
back into e (`keep_own`); a checkpoint with a sync in flight keeps e' and θ before the jump
(`pending`). State per parameter, in the optimizer's self.state[p] beside 'anchor': 'error' e
(float32, p's shape).
"""

from __future__ import annotations

import torch

from ..compress import SparseLoCoTopK
from ..compress.sparseloco_flat import FlatSparseLoCo
from . import sparseloco_groups
from .exchange import GatherAll
from .flat import reuse, spans
from .member import Member
from .sparseloco_groups import _subtract_sent
from .sync_rule import SyncRule


def _difference(anchor: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = θ₀ − θ in float32 (out: float32, contiguous), exact for bf16 parameters."""
    if anchor.dtype == p.dtype == torch.float32:
        return torch.sub(anchor, p, out=out)
    return out.copy_(anchor).sub_(p)


class SparseTopKSync(SyncRule):
    """The top-k of a decayed error feedback, one GatherAll, the plain outer step (module
    docstring); the arguments are SparseLoCo's, checked there. `jumps`: eager and delay > 1."""

    STORE_EXCHANGE = True         # one GatherAll per sync; a message that missed a round returns to e

    def __init__(self, compressor: SparseLoCoTopK, error_decay: float, outer_lr: float, aggregate: str,
                 eager: bool, eager_scale: float, clip: str | None, delay: int):
        self.compressor, self.error_decay, self.outer_lr = compressor, float(error_decay), outer_lr
        self.aggregate, self.eager, self.eager_scale, self.clip = aggregate, eager, eager_scale, clip
        self.jumps = eager and delay > 1
        self.grouped = True                          # False: the per-tensor path, the reference (`sparseloco_groups`)
        self.message = None                          # every parameter's payload in one GatherAll, once connected
        self._eager_jumped = False
        self._unsent = self._x = None                # e' until the landing; θ before the eager jump
        self._own_sent = None        # what receivers decode of this rank's row (per parameter), encode to landing
        self._flat, self._mean = None, None          # FlatSparseLoCo of the layout; Δ̄'s scratch
        self._arrived = None                         # (rows, their grouped read) from `arrival`, until `apply`
        self._grouped = self._grouped_key = None     # GroupedSparseLoCo of the layout, and what it was built for
        self._dtypes = None                          # its tensors by dtype, narrow scratches (`sparseloco_groups.Dtypes`)

    def connect(self, comm) -> None:
        self.message = GatherAll(comm)

    def describe(self, delay: int) -> str:
        c = self.compressor
        return (f"topk={c.topk} chunk={c.chunk} values={c.codec.name} indices={c.indices} "
                f"transform={c.transform.kind} beta={self.error_decay} alpha={self.outer_lr} "
                f"aggregate={self.aggregate} delay={delay}" + ("" if self.clip is None else f" clip={self.clip}"))

    def exchange(self, layout: list[Member]):
        nbytes = sum(self.compressor.payload_nbytes(m.param.shape) for m in layout)
        self.message.resize(len(layout), nbytes, layout[0].param.device)
        return self.message

    def prepare(self, host, layout: list[Member]) -> None:
        for _, p, key in layout:
            if "error" not in host.state[key]:
                host.state[key]["error"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def check(self, host, layout: list[Member]) -> None:
        if self.clip:
            sparseloco_groups.check_clip_layout(self, layout)

    def _flat_for(self, layout: list[Member]) -> FlatSparseLoCo:
        """The compressor over this layout's tensors end to end, rebuilt when the layout changes."""
        shapes, device = [tuple(m.param.shape) for m in layout], layout[0].param.device
        if self._flat is None or self._flat.shapes != shapes or self._flat.device != torch.device(device):
            self._flat = FlatSparseLoCo(self.compressor, shapes, device)
        return self._flat

    def encode(self, host, step: int, layout: list[Member], exchange) -> None:
        """Every parameter's Δ̂ into the message and e' aside (grouped: `sparseloco_groups.encode`)."""
        if self.grouped:
            sparseloco_groups.encode(self, host, step, layout, exchange.payload)
        else:
            self._encode_per_tensor(host, step, layout, exchange)

    def _encode_per_tensor(self, host, step: int, layout: list[Member], exchange) -> None:
        """e and |e| of every parameter, one top-k over them (`FlatSparseLoCo.select`), then each
        parameter's values, e' and eager jump (each pass over it while it is in cache)."""
        flat, places = self._flat_for(layout), spans(m.param.numel() for m in layout)
        n, device = places[-1].stop, layout[0].param.device
        self._unsent = reuse(self._unsent, n, torch.float32, device)
        if self.jumps:
            self._x = reuse(self._x, n, torch.float32, device)
        if host.delay > 1:
            host._launched = reuse(host._launched, n, torch.float32, device)
        self._own_sent = {}
        for i, ((_, p, key), elements) in enumerate(zip(layout, places)):
            state, x = host.state[key], elements.of(self._unsent).view(p.shape)   # [*p.shape] float32: e, then e'
            # Δ = θ₀ − θ
            _difference(state["anchor"], p, out=x)
            # e = β e + Δ
            x.add_(state["error"], alpha=self.error_decay)
            flat.stage(i, x)                                                   # |e| for TopK
        flat.select()
        for i, ((_, p, key), elements) in enumerate(zip(layout, places)):
            state, x = host.state[key], elements.of(self._unsent).view(p.shape)
            # Δ̂ = Q(TopK(e)): this rank's row of the message, and what receivers decode of it
            sent = self._own_sent[i] = flat.encode(i, x, exchange.payload, step)
            # e' = e − Δ̂, committed when the sync lands
            _subtract_sent(x, sent)
            if self.jumps:
                elements.of(self._x).view(p.shape).copy_(p)        # θ before the jump: a sync not made puts it back
                # θ ← θ₀ − c α Δ̂_r: this rank's own message, its estimate of the θ₀ the sync brings
                p.copy_(state["anchor"])
                _subtract_sent(p, sent, self.eager_scale * self.outer_lr)
            if host.delay > 1:
                # θ_s, kept until the sync lands (here, not in `_launch`: while p is in cache)
                elements.of(host._launched).view(p.shape).copy_(p)
        flat.write(exchange.payload)
        self._eager_jumped = self.jumps

    def discard(self, host, step: int, layout: list[Member], exchange) -> None:
        """A sync made on no rank: an eager jump is undone, θ ← θ + (θ_before − θ_s)."""
        self._own_sent = self._arrived = None
        if not self._eager_jumped:
            return
        self._eager_jumped = False
        for (_, p, _), elements in zip(layout, spans(m.param.numel() for m in layout)):
            before = elements.of(self._x).view(p.shape)
            p.copy_(before.sub_(elements.of(host._launched).view(p.shape)).add_(p))

    def keep_own(self, host, step: int, layout: list[Member], exchange) -> None:
        """This rank's message missed the store round: the landing commits e' + Δ̂_r instead of
        e' (= β e + Δ to float rounding: the unsent residual and the message), so nothing it
        computed is lost; θ₀ and θ move with the others' messages, as on every site."""
        if self.grouped:
            sparseloco_groups.add_own(self, step, layout, exchange.payload[None])
        else:
            for (_, p, _), elements, sent in zip(layout, spans(m.param.numel() for m in layout),
                                                 self._own_sent.values()):
                _subtract_sent(elements.of(self._unsent).view(p.shape), sent, -1.0)     # e' + Δ̂_r
        self._own_sent = None                    # its row is not among those the landing reads

    def pending(self) -> dict:
        """A checkpoint with a sync in flight keeps e', the error its apply commits, and θ
        before an eager jump."""
        unsent = {} if self._unsent is None else {"unsent": self._unsent.clone()}   # None: flagged, never applied
        jump = {"before_jump": self._x.clone()} if self._eager_jumped else {}
        return {**unsent, **jump}

    def load_pending(self, host, record, saved: dict) -> None:
        """After the optimizer's θ_s (`PeriodicAveraging._load_pending_launch`), which an
        'eager_jump' of an older checkpoint is read against."""
        self._own_sent = None                                       # the landing reads every row's bytes
        device = record.layout[0].param.device
        self._eager_jumped = "before_jump" in saved or "eager_jump" in saved
        if "before_jump" in saved:
            self._x = saved["before_jump"].to(device).clone()
        elif "eager_jump" in saved:          # written before 'before_jump': θ_before − θ_s, to float rounding
            self._x = saved["eager_jump"].to(device).add(host._launched)
        if "unsent" in saved:
            self._unsent = saved["unsent"].to(device).clone()

    def arrival(self, host, step: int, layout: list[Member], delivery) -> list[torch.Tensor]:
        """Grouped: every rank's rows read and checked on the device, flags for the envelope's
        one host read; `apply` lands what was read here."""
        if not self.grouped:
            return []
        self._arrived = (delivery.data, sparseloco_groups.read(self, layout, delivery.data))
        return self._arrived[1][2]

    def apply(self, host, step: int, layout: list[Member], delivery, skip: torch.Tensor | None = None) -> None:
        rows, self._eager_jumped = delivery.data, False             # [R, payload bytes], rank order
        own, self._own_sent = self._own_sent, None
        if delivery.rows is not None:                               # a store round without some ranks:
            own = None                                              # rows are not indexed by rank
        arrived, self._arrived = self._arrived, None
        if self.grouped:
            read = arrived[1] if arrived is not None and arrived[0] is rows else None   # else not read by `arrival`
            sparseloco_groups.apply(self, host, step, layout, rows, read)
            return
        flat, places = self._flat_for(layout), spans(m.param.numel() for m in layout)
        # every row's kept values, this rank's as its encode left them
        decoded = flat.decode(rows, None if own is None else (host.comm.rank, own))
        for i, ((_, p, key), elements) in enumerate(zip(layout, places)):
            state = host.state[key]
            # Δ̄ = (1/R) Σ_r Δ̂_r, summed in rank order  [*p.shape] float32
            mean = flat.mean(i, decoded, rows, step, self.aggregate, self._mean_of(p))
            # e ← e'
            state["error"].copy_(elements.of(self._unsent).view(p.shape))
            # θ₀ ← θ₀ − α Δ̄   (× 1 is exact: skipped)
            state["anchor"].sub_((mean if self.outer_lr == 1.0 else mean.mul_(self.outer_lr)).to(state["anchor"].dtype))
            # θ ← θ₀   (delay > 1: θ ← θ₀ + (θ − θ_s))
            host._rejoin(p, state["anchor"], elements)

    def _mean_of(self, p: torch.Tensor) -> torch.Tensor:
        """A float32 scratch of p's shape for its Δ̄, reused across parameters and syncs."""
        if self._mean is None or self._mean.numel() < p.numel() or self._mean.device != p.device:
            self._mean = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
        return self._mean[: p.numel()].view(p.shape)
