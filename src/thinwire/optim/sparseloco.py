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

SparseLoCo is the composition of two parts, as DiLoCo is (`thinwire.optim.diloco`):
`LocalSteps` (`thinwire.optim.local_steps`: the inner torch optimizer, whose groups are this
object's groups, so LR schedulers reach it) and the sync rule `SparseTopKSync`
(`thinwire.optim.sparseloco_sync`: the equations above from Δ on). The rest is the periodic
envelope's (`thinwire.optim.periodic`): `nonfinite` (a flagged sync is made on no rank:
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

from ..compress import SparseLoCoTopK
from ..compress.sparseloco_grouped import joins
from ..compress.topk import AGGREGATIONS
from .local_steps import LocalSteps
from .median_clip import check_clip
from .periodic import check_delay, check_sync_every, of_sync
from .sparseloco_sync import SparseTopKSync


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


class SparseLoCo(LocalSteps):
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
            e ← e' + Δ̂_r, `SparseTopKSync.keep_own`).
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
    compressor, error_decay, outer_lr, aggregate, eager, eager_scale, clip = (
        of_sync(name) for name in ("compressor", "error_decay", "outer_lr", "aggregate", "eager", "eager_scale", "clip"))

    @property
    def grouped(self) -> bool:
        """True (default): the sync on the grouped layout; False: the per-tensor path, the
        reference (`thinwire.optim.sparseloco_groups`). Settable."""
        return self.sync.grouped

    @grouped.setter
    def grouped(self, value: bool) -> None:
        self.sync.grouped = value

    def __init__(self, params, inner=None, sync_every: int = 15, topk: int = 128, chunk: int = 64,
                 values: str = "2bit", transform: str = "identity", indices: str = "packed",
                 error_decay: float = 0.95, outer_lr: float = 1.0, aggregate: str = "mean", nonfinite: str = "raise",
                 process_group=None, overlap: bool = False, delay: int = 1, eager: bool = True,
                 eager_scale: float = 1.0, clip: str | None = None):
        check_sync_every(sync_every)
        compressor = _check(topk, chunk, values, transform, indices, error_decay, outer_lr, aggregate)
        if not isinstance(eager, bool):
            raise ValueError(f"eager must be True or False, got {eager!r}")
        eager_scale, clip_rule = _check_eager_scale(eager_scale), check_clip(clip)
        if clip_rule and not joins(compressor, ()):
            raise ValueError(f"clip={clip!r} runs on the grouped path, which needs transform 'identity' and values "
                             f"'2bit' or '8bit', got transform={transform!r}, values={values!r}")
        check_delay(delay, sync_every, overlap)
        sync = SparseTopKSync(compressor, error_decay, outer_lr, aggregate, eager, eager_scale, clip_rule, delay)
        self._init_local_steps(params, inner, process_group, nonfinite, sync_every, sync, overlap, delay)
