"""SparseLoCo: H local steps of AdamW, then each rank sends only the top-k of its decayed
error-feedback accumulator per chunk, in 2 bits (Sarfi, Thérien, Lidin, Belilovsky,
"Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706).

Per round, on every rank r, with θ₀ the parameters all ranks agreed on at the last sync:

    θ_r ← InnerOpt^H(θ₀)                      H local steps of the inner optimizer (AdamW),
                                              no communication
    Δ_r = θ₀ − θ_r                            the pseudo-gradient
    e_r ← β e_r + Δ_r                         error feedback decayed by β: DiLoCo's outer
                                              momentum, kept locally
    Δ̂_r = Q(TopK(e_r))                        top-k by magnitude in every chunk, then the
                                              values quantized (`SparseLoCoTopK`)
    e_r ← e_r − Δ̂_r                           the residual (unsent and quantization error) stays
    Δ̄ = (1/R) Σ_r Δ̂_r                         one all-gathered message; every rank decodes every row in
                                              rank order and sums in that order
    θ₀ ← θ₀ − α Δ̄;  θ ← θ₀                    the plain outer step: every rank leaves bit-identical

All of it is implemented as written. Δ, e and the decoding run in float32 (Δ = θ₀ − θ of bf16
parameters exactly); Δ̂_r is what every receiver decodes from rank r's bytes, so e_r keeps
exactly what the others did not receive.

The message of a sync, one `GatherAll` (one uint8 buffer, all-gathered; over 32 KiB as up to four
all_gathers of its byte ranges in flight at once) for all P parameters:
the envelope's prefix (8-byte header, ceil(P / 8) bytes of presence), then per parameter, in
layout order, `SparseLoCoTopK`'s payload: for a tensor of C chunks of E elements and
k = max(1, round(E · topk / chunk²)) (≤ E) kept per chunk,

    ceil(C · k · ceil(log2 E) / 8)            bit-packed chunk-local indices, then the values:
    2bit  16 + ceil(C · k / 4)                4 float32 levels per tensor, 2-bit codes
    8bit  1024 + C · k                        256 float32 levels per tensor, 1-byte codes
    int8  4 C + C k      bf16  2 C k      fp32  4 C k

(indices='elias-fano': ceil(C k L / 8) + ceil(C (k + ((E − 1) >> L) + 1) / 8) bytes of indices,
L = floor(log2(E / k)), each chunk's ascending and its values in that order;
`thinwire.wire.indices`), so bytes per sync = 8 + ceil(P / 8) + Σ_params (indices + values), and
nothing on local steps.
The sync computes them on the grouped layout (`thinwire.optim.sparseloco_groups`, the same
bytes as `SparseLoCoTopK` tensor by tensor): a number of batched operations per chunk shape,
not per parameter, and no host read of its own, for float32, bf16 and fp16 parameters (θ and
θ₀ rounded to their dtype where the per-tensor path rounds them). `opt.grouped = False` takes
the per-tensor path, the reference: `FlatSparseLoCo`, each parameter's Δ, e and |e|, one top-k per group,
each parameter's values, e' and eager jump while it is in cache, the packing and, at the
landing, the reading batched over parameters of one chunk shape.
Chunks are `ChunkPlan`'s (a tensor viewed as a matrix, each dimension cut into chunks of at
most `chunk`, zero-padded when it has no divisor in [chunk/2, chunk]).

Defaults, the paper's 512M setting (the reference repository's sweep file for it): H = 15,
chunk 64 (64 × 64 = 4096 elements), top-128 per chunk (3.1 % density), β = 0.95, α = 1, 2-bit
values (4 levels, a range of 6 sigmas), inner AdamW; top-k on the values themselves
('identity'; 'dct' is DeMo's domain, an option in the paper and the reference too).

Where this differs from the paper's reference code (tplr's sparseloco.py):
  * aggregation: the paper's mean over all R ranks (aggregate='mean'); the reference averages
    each element over the ranks that sent it (scatter_reduce 'mean'): aggregate='senders'.
  * 2-bit values: four levels per tensor (the means of its bins, statistics in float64) instead
    of the reference's shift and four bin means of the centred values in float32: the same
    levels up to rounding, one float fewer (`thinwire.wire.twobit`); codes are bit-packed.
  * outer learning rate: the reference scales e's input by its learning rate a as well
    (e ← β e + a Δ before p ← p − a Δ̄, its outer optimizer plain SGD at lr a); the paper's
    equations, implemented here, do not. Its e is therefore a times this one (top-k picks the
    same positions, and the 2-bit levels scale with their input), so its step a · a Δ̄ is
    outer_lr = a² here: Templar at a is SparseLoCo(..., outer_lr=a**2) (to float rounding;
    tests/test_coming_from.py). With a = 1 they agree.
  * chunks: a dimension with no divisor in [chunk/2, chunk] is zero-padded up to a multiple of
    chunk (the reference takes its largest divisor ≤ chunk: 130 → chunks of 26 at chunk 64, a
    prime → chunks of 1, every element sent).
  * 8-bit values: the reference's TopKCompressor defaults to its statistical quantizer with 256
    levels (its hparams.json sets 4: '2bit'): values='8bit' (`thinwire.wire.eightbit`), with the
    2-bit one's differences (statistics in float64, 256 levels sent as bin means instead of a
    shift and 256 centred means; on a row whose mean is large against its spread the
    reference's float32 rounds its levels to an ulp of the mean). values='int8' is another
    quantizer: absmax per chunk (a float32 scale per chunk, codes in [−127, 127]).
  * k keeps the density on smaller chunks with transform='dct' too (the reference scales k
    only on its identity path).
  * indices are ceil(log2 E)-bit packed and everything travels in one all-gathered buffer (the
    reference all-gathers int64 indices, values and quantization parameters apart).

Everything else is DiLoCo's (`thinwire.optim.diloco`, `periodic`): the inner optimizer's groups are
this object's groups (LR schedulers reach it); `nonfinite` (a flagged sync is made on no rank:
anchor and e unchanged); `overlap=True` (the sync's all-gather leaves at its step and lands at
the next step(): the delayed outer step, one step late); checkpoints (a sync in flight keeps
e' = e − Δ̂ aside until it lands); elastic remap (e per rank by the interval rule, θ₀ kept).
Two tiers (FSDP2 shards, `process_group` = the group across sites): the chunking, top-k and
quantization run on this rank's shard, exchanged with the ranks holding it in the other sites.

Delayed syncs (`delay=τ` > 1 with overlap; an improvement, not in the paper): the sync of step s
lands at the start of step s + τ (`thinwire.optim.periodic`), θ₀ and e move then, and each
replica keeps its local steps made meanwhile. With `eager=True` (the default) it first jumps,
at step s, to its own estimate of the θ₀ the sync brings, from its own message (the eager
update of overlapped DiLoCo, Kale et al. 2025, with the sparse message in place of the
dense pseudo-gradient):

    θ ← θ_s = θ₀ − c α Δ̂_r                    at step s, after the message is encoded
    θ ← θ₀' + (θ − θ_s)                       when it lands (θ₀' = θ₀ − α Δ̄)

so the local steps in flight start where the sync will roughly put the replica, and what
Δ̂_r left out stays in e, as in a plain round. c (`eager_scale`, default 1: the estimate
itself) only moves where the in-flight steps take their gradients: the landing puts every
replica on θ₀' whatever c was, keeping the steps made since. On `wan` (2 ranks, H 6 and 8)
c = 1.5 was better on one seed and worse on another, by single-seed noise, and 0.75 and 3 ended
worse (docs/results/2026-11-25-sparseloco-h6.md). A sync made on no rank (non-finite gradients)
undoes the jump (θ ← θ + (θ_before − θ_s), to float rounding). eager=False keeps the replica
where it stood (DiLoCo's rule). Measured on `wan` (H 8, 600 steps): eager ends 0.2-0.6 %
above the undelayed run's loss at τ 4-8, the plain rule 1.1-5.3 % above it
(docs/results/2026-11-24-sparseloco-delayed.md). An elastic resume with an eager jump in flight
is refused (flush() before that checkpoint): the jump lives in the model, not in the state.

State per parameter, in self.state[p]: 'anchor' θ₀ (p's dtype and shape), 'error' e (float32,
p's shape).
"""

from __future__ import annotations

import torch

from ..compress import SparseLoCoTopK
from ..compress.sparseloco_flat import FlatSparseLoCo
from ..compress.sparseloco_grouped import joins
from ..compress.topk import AGGREGATIONS
from .base import Member
from .diloco import DiLoCo
from .exchange import GatherAll
from .flat import spans
from . import sparseloco_groups
from .flat import reuse
from .periodic import check_sync_every
from .median_clip import check_clip
from .sparseloco_groups import _subtract_sent


def _check(topk, chunk, values, transform, indices, error_decay, outer_lr, aggregate) -> SparseLoCoTopK:
    if not 0.0 <= error_decay <= 1.0:
        raise ValueError(f"error_decay must be in [0, 1], got {error_decay}")
    if not outer_lr > 0.0:
        raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
    if aggregate not in AGGREGATIONS:
        raise ValueError(f"aggregate must be one of {AGGREGATIONS}, got {aggregate!r}")
    for name, value in (("topk", topk), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return SparseLoCoTopK(topk, chunk, transform, values, indices)   # ValueError naming values / transform / topk / indices


def _check_eager_scale(value) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0.0 <= value < float("inf"):                  # NaN fails the comparison too
        raise ValueError(f"eager_scale must be a finite number >= 0, got {value!r}")
    return float(value)


def _difference(anchor: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = θ₀ − θ in float32 (out: float32, contiguous), exact for bf16 parameters."""
    if anchor.dtype == p.dtype == torch.float32:
        return torch.sub(anchor, p, out=out)
    return out.copy_(anchor).sub_(p)


class SparseLoCo(DiLoCo):
    """SparseLoCo over any inner optimizer; the module docstring has the equations and the wire.

    Args:
        inner: callable params -> torch.optim.Optimizer (default torch.optim.AdamW, lr 1e-3).
        sync_every: H, local steps between syncs (default 15, the paper's).
        topk: values kept per chunk × chunk chunk (default 128: 3.1 %); smaller chunks keep
            the same density. 1 <= topk <= chunk².
        chunk: target chunk side (default 64: 64 × 64 chunks).
        values: '2bit' (default, 4 levels per tensor) | '8bit' (256 levels per tensor: 1 KiB of
            levels a tensor, then a byte a value; Templar's default) | 'int8' | 'bf16' | 'fp32'.
        transform: 'identity' (default: top-k of the values) | 'dct' (of their chunked DCT-II).
        indices: 'packed' (default: ceil(log2 E) bits each) | 'elias-fano' (each chunk's ascending,
            about log2(E / k) + 2 bits each: 7 instead of 10 at 32 of 1024; lossless, the same Δ̂).
        error_decay: β of e ← β e + Δ (default 0.95).
        outer_lr: α of θ₀ ← θ₀ − α Δ̄ (default 1.0).
        aggregate: 'mean' (default, the paper's 1/R) | 'senders' (the reference code's).
        nonfinite, process_group, overlap, delay: as for DiLoCo; process_group may also be a
            `thinwire.store.StoreGroup` (a site whose message misses a round keeps it in e:
            e ← e' + Δ̂_r, `_keep_own`).
        eager: with delay > 1, each replica jumps to θ₀ − c α Δ̂_r when its sync leaves (default
            True; the module docstring).
        eager_scale: c of that jump, a finite number >= 0 (default 1: its own message's estimate
            of θ₀'; 0 jumps to θ₀).
        clip: None (default) or 'median-norm': before the aggregate, each sender's Δ̂_r of each
            tensor is scaled by min(1, median_r ‖Δ̂_r‖ / ‖Δ̂_r‖) over the delivered senders
            (Templar's guard; `thinwire.optim.median_clip`). On the grouped path only: needs
            transform 'identity', values '2bit' or '8bit' and float32/bf16/fp16 parameters.
    Initial parameters must be identical on all ranks (as with DDP's broadcast).
    """

    kind = "sparseloco"
    STORE_EXCHANGE = True         # one GatherAll per sync; a message that missed a round returns to e

    def __init__(self, params, inner=None, sync_every: int = 15, topk: int = 128, chunk: int = 64,
                 values: str = "2bit", transform: str = "identity", indices: str = "packed",
                 error_decay: float = 0.95, outer_lr: float = 1.0, aggregate: str = "mean", nonfinite: str = "raise",
                 process_group=None, overlap: bool = False, delay: int = 1, eager: bool = True,
                 eager_scale: float = 1.0, clip: str | None = None):
        check_sync_every(sync_every)
        self.compressor = _check(topk, chunk, values, transform, indices, error_decay, outer_lr, aggregate)
        if not isinstance(eager, bool):
            raise ValueError(f"eager must be True or False, got {eager!r}")
        self.eager_scale = _check_eager_scale(eager_scale)
        self.clip = check_clip(clip)
        if self.clip and not joins(self.compressor, ()):
            raise ValueError(f"clip={clip!r} runs on the grouped path, which needs transform 'identity' and values "
                             f"'2bit' or '8bit', got transform={transform!r}, values={values!r}")
        self.error_decay, self.aggregate, self.eager, self._eager_jumped = float(error_decay), aggregate, eager, False
        self._own_sent = None        # what receivers decode of this rank's row (per parameter), encode to landing
        self._flat, self._mean = None, None          # FlatSparseLoCo of the layout; Δ̄'s scratch
        self.grouped = True                          # False: the per-tensor path, the reference (`sparseloco_groups`)
        self._arrived = None                         # (rows, their grouped read) from `_arrival`, until `_apply`
        self._grouped = self._grouped_key = None     # GroupedSparseLoCo of the layout, and what it was built for
        self._dtypes = None                          # its tensors by dtype, narrow scratches (`sparseloco_groups.Dtypes`)
        super().__init__(params, inner=inner, sync_every=sync_every, outer_lr=outer_lr, outer_momentum=0.0,
                         wire="fp32", nonfinite=nonfinite, process_group=process_group, overlap=overlap,
                         delay=delay)
        self._message = GatherAll(self.comm)        # every parameter's payload in one message

    def _describe(self, layout: list[Member]) -> str:
        c = self.compressor
        head = (f"{self.kind} world_size={self.comm.world_size} K={self.sync_every} topk={c.topk} chunk={c.chunk} "
                f"values={c.codec.name} indices={c.indices} transform={c.transform.kind} beta={self.error_decay} "
                f"alpha={self.outer_lr} aggregate={self.aggregate} delay={self.delay}"
                + ("" if self.clip is None else f" clip={self.clip}"))
        return "\n".join([head, *(f"{tuple(p.shape)} {p.dtype}" for _, p, _ in layout)])

    def _exchange(self, step: int, layout: list[Member]):
        if step % self.sync_every or not layout:
            return None                                             # a local step
        nbytes = sum(self.compressor.payload_nbytes(m.param.shape) for m in layout)
        self._message.resize(len(layout), nbytes, layout[0].param.device)
        return self._message

    def _prepare(self, step: int, layout: list[Member]) -> None:
        super()._prepare(step, layout)                              # θ₀
        for _, p, key in layout:
            if "error" not in self.state[key]:
                self.state[key]["error"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _flat_for(self, layout: list[Member]) -> FlatSparseLoCo:
        """The compressor over this layout's tensors end to end, rebuilt when the layout changes."""
        shapes, device = [tuple(m.param.shape) for m in layout], layout[0].param.device
        if self._flat is None or self._flat.shapes != shapes or self._flat.device != torch.device(device):
            self._flat = FlatSparseLoCo(self.compressor, shapes, device)
        return self._flat

    def _encode(self, step: int, layout: list[Member], exchange) -> None:
        """The local step; at a sync, then every parameter's Δ̂ into the message and e' aside
        (grouped: `sparseloco_groups.encode`)."""
        if exchange is not None and self.clip:               # before anything moves or is sent
            sparseloco_groups.check_clip_layout(self, layout)
        self._local_step(step, layout)
        if exchange is not None and self.grouped:
            sparseloco_groups.encode(self, step, layout, exchange.payload)
        elif exchange is not None:
            self._encode_per_tensor(step, layout, exchange)

    def _encode_per_tensor(self, step: int, layout: list[Member], exchange) -> None:
        """e and |e| of every parameter, one top-k over them (`FlatSparseLoCo.select`), then each
        parameter's values, e' and eager jump (each pass over it while it is in cache)."""
        flat, places = self._flat_for(layout), spans(m.param.numel() for m in layout)
        n, device = places[-1].stop, layout[0].param.device
        self._unsent = reuse(self._unsent, n, torch.float32, device)
        if self._eager_now:
            self._x = reuse(self._x, n, torch.float32, device)
        if self.delay > 1:
            self._launched = reuse(self._launched, n, torch.float32, device)
        self._own_sent = {}
        for i, ((_, p, key), elements) in enumerate(zip(layout, places)):
            state, x = self.state[key], elements.of(self._unsent).view(p.shape)   # [*p.shape] float32: e, then e'
            # Δ = θ₀ − θ
            _difference(state["anchor"], p, out=x)
            # e = β e + Δ
            x.add_(state["error"], alpha=self.error_decay)
            flat.stage(i, x)                                                   # |e| for TopK
        flat.select()
        for i, ((_, p, key), elements) in enumerate(zip(layout, places)):
            state, x = self.state[key], elements.of(self._unsent).view(p.shape)
            # Δ̂ = Q(TopK(e)): this rank's row of the message, and what receivers decode of it
            sent = self._own_sent[i] = flat.encode(i, x, exchange.payload, step)
            # e' = e − Δ̂, committed when the sync lands
            _subtract_sent(x, sent)
            if self._eager_now:
                elements.of(self._x).view(p.shape).copy_(p)        # θ before the jump: a sync not made puts it back
                # θ ← θ₀ − c α Δ̂_r: this rank's own message, its estimate of the θ₀ the sync brings
                p.copy_(state["anchor"])
                _subtract_sent(p, sent, self.eager_scale * self.outer_lr)
            if self.delay > 1:
                # θ_s, kept until the sync lands (here, not in `_launch`: while p is in cache)
                elements.of(self._launched).view(p.shape).copy_(p)
        flat.write(exchange.payload)
        self._eager_jumped = self._eager_now

    @property
    def _eager_now(self) -> bool:
        return self.eager and self.delay > 1

    def _discard(self, step: int, layout: list[Member], exchange) -> None:
        """A sync made on no rank: an eager jump is undone, θ ← θ + (θ_before − θ_s)."""
        self._own_sent = self._arrived = None
        if not self._eager_jumped:
            return
        self._eager_jumped = False
        for (_, p, _), elements in zip(layout, spans(m.param.numel() for m in layout)):
            before = elements.of(self._x).view(p.shape)
            p.copy_(before.sub_(elements.of(self._launched).view(p.shape)).add_(p))

    def _keep_own(self, step: int, layout: list[Member], exchange) -> None:
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

    def _pending_state(self, record) -> dict:
        """A checkpoint with a sync in flight keeps e', the error its apply commits."""
        unsent = {} if self._unsent is None else {"unsent": self._unsent.clone()}   # None: flagged, never applied
        jump = {"before_jump": self._x.clone()} if self._eager_jumped else {}
        return {**self._pending_launch(), **unsent, **jump}

    def _load_pending_state(self, record, saved: dict) -> None:
        self._load_pending_launch(record, saved)
        self._own_sent = None                                       # the landing reads every row's bytes
        device = record.layout[0].param.device
        self._eager_jumped = "before_jump" in saved or "eager_jump" in saved
        if "before_jump" in saved:
            self._x = saved["before_jump"].to(device).clone()
        elif "eager_jump" in saved:          # written before 'before_jump': θ_before − θ_s, to float rounding
            self._x = saved["eager_jump"].to(device).add(self._launched)
        if "unsent" in saved:
            self._unsent = saved["unsent"].to(device).clone()

    def _arrival(self, step: int, layout: list[Member], delivery) -> list[torch.Tensor]:
        """Grouped: every rank's rows read and checked on the device, flags for the envelope's
        one host read; `_apply` lands what was read here."""
        if not self.grouped:
            return []
        self._arrived = (delivery.data, sparseloco_groups.read(self, layout, delivery.data))
        return self._arrived[1][2]

    def _apply(self, step: int, layout: list[Member], delivery) -> None:
        rows, self._eager_jumped = delivery.data, False             # [R, payload bytes], rank order
        own, self._own_sent = self._own_sent, None
        if delivery.rows is not None:                               # a store round without some ranks:
            own = None                                              # rows are not indexed by rank
        arrived, self._arrived = self._arrived, None
        if self.grouped:
            read = arrived[1] if arrived is not None and arrived[0] is rows else None   # else not read by `_arrival`
            sparseloco_groups.apply(self, step, layout, rows, read)
            return
        flat, places = self._flat_for(layout), spans(m.param.numel() for m in layout)
        # every row's kept values, this rank's as its encode left them
        decoded = flat.decode(rows, None if own is None else (self.comm.rank, own))
        for i, ((_, p, key), elements) in enumerate(zip(layout, places)):
            state = self.state[key]
            # Δ̄ = (1/R) Σ_r Δ̂_r, summed in rank order  [*p.shape] float32
            mean = flat.mean(i, decoded, rows, step, self.aggregate, self._mean_of(p))
            # e ← e'
            state["error"].copy_(elements.of(self._unsent).view(p.shape))
            # θ₀ ← θ₀ − α Δ̄   (× 1 is exact: skipped)
            state["anchor"].sub_((mean if self.outer_lr == 1.0 else mean.mul_(self.outer_lr)).to(state["anchor"].dtype))
            # θ ← θ₀   (delay > 1: θ ← θ₀ + (θ − θ_s))
            self._rejoin(p, state["anchor"], elements)

    def _mean_of(self, p: torch.Tensor) -> torch.Tensor:
        """A float32 scratch of p's shape for its Δ̄, reused across parameters and syncs."""
        if self._mean is None or self._mean.numel() < p.numel() or self._mean.device != p.device:
            self._mean = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
        return self._mean[: p.numel()].view(p.shape)
