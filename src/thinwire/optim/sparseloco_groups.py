"""SparseLoCo's sync on the grouped layout: the equations of `thinwire.optim.sparseloco` (its
module docstring) with a number of operations that does not grow with the parameter count.

    Δ = θ₀ − θ;  e = β e + Δ        `_foreach_copy_`, `_foreach_sub_`, `_foreach_add_` into the
                                    flat e' buffer (tensor by tensor in layout order, as before)
    Δ̂_r = Q(TopK(e))               `GroupedSparseLoCo`: one top-k per chunk shape, one 2-bit
                                    (or 8-bit) quantization of every kept value (levels per tensor), one
                                    packing per stream, one scatter into the message
    e' = e − Δ̂_r                   one index_add_ of every kept value into the flat e'
    θ ← θ₀ − c α Δ̂_r (eager)       in the flat θ_s buffer: `_foreach_copy_`, one index_add_,
                                    `_foreach_copy_` back into the parameters
    Δ̄ = (1/R) Σ_r Δ̂_r              one read of every rank's bytes, checked on the device and
                                    read once; one index_add_ per rank, in rank order, into a
                                    flat Δ̄; one division
    e ← e';  θ₀ ← θ₀ − α Δ̄;  θ ← θ₀ (+ θ − θ_s)   `_foreach_*` ops

Each function takes the rule (`sync`, a `SparseTopKSync`: its settings, e', the scratches) and,
where it reads self.state or θ_s, the optimizer (`host`, `thinwire.optim.periodic`).

A parameter joins when it is float32, bfloat16 or float16 and `sparseloco_grouped.joins` its
shape ('identity' top-k, '2bit' or '8bit' values; padded chunks too); the others go tensor by tensor as
on the per-tensor path (`SparseLoCo.grouped = False` sends every parameter there: the
reference, bit for bit the same on CPU, tests/optim/test_sparseloco_groups.py). On a GPU, a
top-k over more rows may break ties between equal magnitudes otherwise, and `_foreach_add_`
may fuse β e + Δ into one rounding.

Narrow parameters (bf16, fp16; `Dtypes`). Δ, e, e', Δ̄ and θ_s stay float32 in the flat
buffers, so the compressor and the landing's sums never see the dtype; θ and θ₀ are rounded
to it where the per-tensor path rounds them, and nowhere else:

    Δ = θ₀ − θ                 θ₀ and θ widened exactly, one float32 subtraction (`_difference`)
    θ_s = θ₀ − c α Δ̂_r         c α Δ̂_r in float32, rounded to θ's dtype, then one rounding of
                               the subtraction in it (`_subtract_sent`), θ_s widened exactly
    θ₀ ← θ₀ − α Δ̄              α Δ̄ rounded to θ₀'s dtype, then one rounding of the subtraction
    θ ← θ₀ + (θ − θ_s)         θ − θ_s + θ₀ in float32 (θ, θ₀ widened exactly), rounded once
                               (`PeriodicAveraging._rejoin`)

Each narrow dtype has a flat scratch of the layout's size in that dtype (`Dtypes.low`, tensor
i at `offsets[i]` as in the float32 buffers): its tensors go in and out of it with
`_foreach_copy_` (one dtype in every list: a `_foreach_*` over mixed dtypes is a loop over
tensors on a GPU), and it meets a float32 buffer in one whole-buffer cast or elementwise op
(a few launches more than float32 per sync and per landing, none per tensor, no host read).
Such an op writes every tensor's place, so with one narrow dtype the float32 (and other)
tensors' places are written after it (or read before it); with two (bf16 and fp16 in one
layout) each computes in a float32 spare and one `_foreach_copy_` lands its own places.
Other dtypes (float64) go alone, their `_foreach_*` lists a launch per tensor.
"""

from __future__ import annotations

import torch

from ..compress.sparseloco_flat import alone_mean
from ..compress.sparseloco_grouped import GroupedSparseLoCo
from ..compress.sparseloco_topk import Sent
from ..compress.topk import raise_malformed
from ..wire import checks
from .base import Member
from .flat import reuse
from .median_clip import clip_rows
from .periodic import slots_of

NARROW = (torch.bfloat16, torch.float16)
JOINING = (torch.float32, *NARROW)


def _subtract_sent(target: torch.Tensor, sent: Sent, scale: float | None = None) -> None:
    """target ← target − (scale · Δ̂) in target's dtype, Δ̂ as `encode_sent` gives it: values at
    flat positions (elsewhere target − 0 = target, so only those are touched) or dense."""
    positions, values = sent.positions, sent.values
    if scale is not None:
        values = values * scale
    values = values.to(target.dtype)
    if positions is None:
        target.sub_(values)
    elif target.is_contiguous():
        # a + (−v) is a − v exactly; positions are distinct, so no two additions meet
        target.view(-1).index_add_(0, positions, values.neg())
    else:
        target.sub_(torch.zeros(target.shape, dtype=values.dtype, device=values.device)
                    .view(-1).index_put_((positions,), values).view(target.shape))


def _pick(items: list, indices: list[int]) -> list:
    return [items[i] for i in indices]


def _views(flat: torch.Tensor, g: GroupedSparseLoCo, layout: list[Member]) -> list[torch.Tensor]:
    return [flat[at: at + m.param.numel()].view(m.param.shape) for at, m in zip(g.offsets, layout)]


class Dtypes:
    """The layout's tensors by dtype (module docstring): `wide` float32, `narrow` {bf16 / fp16:
    its tensors}, `other` (float64...), `joined` of each (`GroupedSparseLoCo.tensors`); per
    narrow dtype the flat scratch `low` (zeros once) and `lows` its views; `spare`, a flat
    float32 scratch, only with two narrow dtypes."""

    def __init__(self, layout: list[Member], g: GroupedSparseLoCo, n: int, device):
        dtypes = [m.param.dtype for m in layout]
        self.wide = [i for i, d in enumerate(dtypes) if d == torch.float32]
        self.other = [i for i, d in enumerate(dtypes) if d not in JOINING]
        self.narrow = {d: [i for i, e in enumerate(dtypes) if e == d] for d in NARROW if d in dtypes}
        joined = set(g.tensors)
        self.joined = {d: [i for i in members if i in joined]
                       for d, members in [(torch.float32, self.wide), *self.narrow.items()]}
        self.low = {d: torch.zeros(n, dtype=d, device=device) for d in self.narrow}
        self.lows = {d: _views(low, g, layout) for d, low in self.low.items()}
        self.spare = torch.empty(n, device=device) if len(self.narrow) > 1 else None
        self.spares = None if self.spare is None else _views(self.spare, g, layout)

    def work(self, dst: torch.Tensor) -> torch.Tensor:
        """Where a narrow dtype's float32 values for `dst` are computed by whole-buffer ops:
        dst itself (one narrow dtype: the caller writes the other places after), or the spare."""
        return dst if self.spare is None else self.spare

    def land(self, dst_views: list[torch.Tensor], members: list[int]) -> None:
        """After `work`: the members' places of the spare into dst's (nothing with one narrow dtype)."""
        if self.spare is not None:
            torch._foreach_copy_(_pick(dst_views, members), _pick(self.spares, members))

    def widen(self, dst: torch.Tensor, dst_views: list[torch.Tensor]) -> None:
        """Every narrow tensor's place of dst ← its scratch's (exact), whatever the scratch holds."""
        for d, members in self.narrow.items():
            self.work(dst).copy_(self.low[d])
            self.land(dst_views, members)


def grouped_for(sync, layout: list[Member]) -> GroupedSparseLoCo:
    """The layout's grouped compressor (and `sync._dtypes`), rebuilt when its shapes, dtypes or
    device change."""
    key = tuple((tuple(m.param.shape), m.param.dtype) for m in layout), layout[0].param.device
    if sync._grouped_key != key:
        eligible = [m.param.dtype in JOINING for m in layout]
        g = GroupedSparseLoCo(sync.compressor, [m.param.shape for m in layout], key[1], eligible)
        sync._dtypes = Dtypes(layout, g, g.offsets[-1] + layout[-1].param.numel(), key[1])
        sync._grouped, sync._grouped_key = g, key
    return sync._grouped


def _difference(k: Dtypes, x: torch.Tensor, xs, anchors, params) -> None:
    """x = θ₀ − θ, float32, every tensor (as `sparseloco_sync._difference`). A narrow scratch keeps θ
    afterwards (`_launch` and θ before the jump take it from there)."""
    for d, members in k.narrow.items():
        low, lows, work = k.low[d], k.lows[d], k.work(x)
        torch._foreach_copy_(_pick(lows, members), _pick(anchors, members))
        work.copy_(low)                                     # θ₀, widened exactly
        torch._foreach_copy_(_pick(lows, members), _pick(params, members))
        work.sub_(low)                                      # − θ, in float32
        k.land(xs, members)
    rest = k.wide + k.other                                 # after the whole-buffer ops
    if rest:
        torch._foreach_copy_(_pick(xs, rest), _pick(anchors, rest))
        torch._foreach_sub_(_pick(xs, rest), _pick(params, rest))


def encode(sync, host, step: int, layout: list[Member], payload: torch.Tensor) -> None:
    """The sync's message and e' aside (and with delay > 1: θ_s, the eager jump), grouped."""
    g, device = grouped_for(sync, layout), layout[0].param.device
    k = sync._dtypes
    n = g.offsets[-1] + layout[-1].param.numel()
    sync._unsent, sync._mean = reuse(sync._unsent, n, torch.float32, device), reuse(sync._mean, n, torch.float32, device)
    states, params = [host.state[m.key] for m in layout], [m.param for m in layout]
    xs, anchors = _views(sync._unsent, g, layout), [st["anchor"] for st in states]
    # Δ = θ₀ − θ   (float32, exact for bf16 θ)
    _difference(k, sync._unsent, xs, anchors, params)
    # e = β e + Δ
    torch._foreach_add_(xs, [st["error"] for st in states], alpha=sync.error_decay)
    g.select(sync._unsent, sync._mean)                        # the Δ̄ scratch as the stage: free until landing
    positions, sent = g.encode(sync._unsent, payload)
    # e' = e − Δ̂, committed when the sync lands: a + (−1)·v is a − v exactly, positions distinct
    sync._unsent.index_add_(0, positions, sent, alpha=-1.0)
    if host.delay > 1:
        host._launched = reuse(host._launched, n, torch.float32, device)
        if sync.jumps:
            # θ before the jump: a sync not made puts it back (narrow: from the scratch, θ since Δ)
            sync._x = reuse(sync._x, n, torch.float32, device)
            before = _views(sync._x, g, layout)
            k.widen(sync._x, before)
            rest = k.wide + k.other
            if rest:
                torch._foreach_copy_(_pick(before, rest), _pick(params, rest))
        _launch(sync, host, g, layout, positions, sent)     # before the tensors alone: it writes their θ_s places
    for i in g.alone:                                       # tensor by tensor (their Sent shares a scratch)
        _alone(sync, host, step, g, layout[i].param, anchors[i], xs[i], i, payload)
    sync._own_sent, sync._eager_jumped = None, sync.jumps


def _alone(sync, host, step: int, g: GroupedSparseLoCo, p, anchor, x, i: int, payload) -> None:
    """A tensor that cannot join: its Δ̂ into the message, e', and θ_s / the jump, as per tensor."""
    sent = sync.compressor.encode_sent(x, g.payloads[i].of(payload), step)
    _subtract_sent(x, sent)                                 # e' = e − Δ̂
    if sync.jumps:
        # θ ← θ₀ − c α Δ̂_r, in the parameter's dtype
        p.copy_(anchor)
        _subtract_sent(p, sent, sync.eager_scale * sync.outer_lr)
    if host.delay > 1:
        kept = host._launched[g.offsets[i]: g.offsets[i] + p.numel()].view(p.shape)
        kept.copy_(p)                                       # θ_s


def _launch(sync, host, g: GroupedSparseLoCo, layout: list[Member], positions, sent) -> None:
    """θ_s of the joined tensors kept until the sync lands; with `eager`, the jump first. The
    places of the tensors alone are written over: `_alone` writes them after."""
    if not g.tensors:
        return
    k, params, launched = sync._dtypes, [m.param for m in layout], _views(host._launched, g, layout)
    wide = k.joined[torch.float32]
    if not sync.jumps:
        k.widen(host._launched, launched)                   # θ_s = θ: the narrow scratches hold θ since Δ
        if wide:
            torch._foreach_copy_(_pick(launched, wide), _pick(params, wide))
        return
    anchors = [host.state[m.key]["anchor"] for m in layout]
    scale = sync.eager_scale * sync.outer_lr
    if wide:
        # θ_s = θ₀ − c α Δ̂_r in the flat θ_s (at every kept position: the narrow places are
        # written after), then θ ← θ_s
        torch._foreach_copy_(_pick(launched, wide), _pick(anchors, wide))
        if scale == 1.0:                                    # a + (−1)·v: exact, as a + (−v)
            host._launched.index_add_(0, positions, sent, alpha=-1.0)
        else:                                               # the product rounded first, as per tensor
            host._launched.index_add_(0, positions, sent.mul(scale).neg_())
        torch._foreach_copy_(_pick(params, wide), _pick(launched, wide))
    over = False
    for d in k.narrow:
        members = k.joined[d]
        if not members:
            continue
        low, lows = k.low[d], k.lows[d]
        # θ_s = θ₀ − c α Δ̂_r in θ's dtype: −(c α Δ̂_r) rounded to it, then θ₀ + that rounded once
        # (as `_subtract_sent`: (−s)·v = −(s·v) and rounding is symmetric)
        torch._foreach_copy_(_pick(lows, members), _pick(anchors, members))
        low.index_add_(0, positions, sent.mul(-scale).to(d))
        torch._foreach_copy_(_pick(params, members), _pick(lows, members))
        k.work(host._launched).copy_(low)                   # θ_s, widened exactly
        k.land(launched, members)
        over = over or k.spare is None
    if wide and over:                                       # the whole-buffer cast wrote the float32 places
        torch._foreach_copy_(_pick(launched, wide), _pick(params, wide))


def read(sync, layout: list[Member], rows: torch.Tensor) -> tuple:
    """Every rank's row [R, payload bytes] of the joined tensors: (positions [R, K], values
    [R, K], device flags of malformed bytes)."""
    return grouped_for(sync, layout).read(rows)


def apply(sync, host, step: int, layout: list[Member], rows: torch.Tensor, arrived: tuple | None = None) -> None:
    """Δ̄ from every rank's row (rank order), then e ← e', θ₀ ← θ₀ − α Δ̄, θ ← θ₀ (+ θ − θ_s).
    arrived: `read`'s answer, checked by the envelope's one host read; without it the rows are
    read and checked here (one host read), before anything moves."""
    g, device = grouped_for(sync, layout), layout[0].param.device
    k = sync._dtypes
    if arrived is None:
        arrived = g.read(rows)
        raise_malformed(checks.any_of(arrived[2]), f" at step {step}")
    positions, values, _ = arrived
    if sync.clip and rows.shape[0] > 1:                      # each sender's tensors to the median norm (1 row: × 1)
        values = clip_rows(values, g.segment.row, g.segment.lengths)
    n = sync._unsent.numel()
    mean = sync._mean = reuse(sync._mean, n, torch.float32, device)
    means = _views(mean, g, layout)
    mean.zero_()
    for r in range(rows.shape[0]):                          # Σ_r Δ̂_r in rank order: no atomics across ranks
        mean.index_add_(0, positions[r], values[r])
    if sync.aggregate == "mean":
        mean.div_(rows.shape[0])
    else:                                                   # 'senders': each element over the ranks that sent it
        counts = sync.compressor.scratch(n, device)[:n].zero_()
        padding = g.received_padding                        # a value in a padding counts 0 at position 0
        for r in range(rows.shape[0]):
            counts.index_add_(0, positions[r], torch.ones_like(values[r]) if padding is None else (~padding[r]).float())
        mean.div_(counts.clamp_(min=1))
    for i in g.alone:
        means[i].copy_(alone_mean(sync.compressor, g.shapes[i], g.payloads[i], rows, step, sync.aggregate).view(g.shapes[i]))
    states = [host.state[m.key] for m in layout]
    anchors = [st["anchor"] for st in states]
    # e ← e'
    torch._foreach_copy_([st["error"] for st in states], _views(sync._unsent, g, layout))
    if sync.outer_lr != 1.0:                                 # × 1 is exact: skipped
        mean.mul_(sync.outer_lr)
    # θ₀ ← θ₀ − α Δ̄   (narrow: α Δ̄ rounded to θ₀'s dtype first, as per tensor)
    if k.wide:
        torch._foreach_sub_(_pick(anchors, k.wide), _pick(means, k.wide))
    for d, members in k.narrow.items():
        k.low[d].copy_(mean)
        torch._foreach_sub_(_pick(anchors, members), _pick(k.lows[d], members))
    for i in k.other:
        anchors[i].sub_(means[i].to(anchors[i].dtype))
    # θ ← θ₀   (delay > 1: θ ← θ₀ + (θ − θ_s))
    _rejoin(sync, host, g, layout, anchors)


def check_clip_layout(sync, layout: list[Member]) -> None:
    """ValueError unless every tensor of `layout` can be clipped: the median-norm clip runs on
    the grouped landing (`apply`), and the per-tensor code (`alone`, or grouped False) has none."""
    if not sync.grouped:
        raise ValueError(f"clip={sync.clip!r} runs on the grouped path only: set grouped back to True")
    g = grouped_for(sync, layout)
    if g.alone:
        raise ValueError(f"clip={sync.clip!r} runs on the grouped path only, and these parameters are not "
                         f"float32, bf16 or fp16: {[g.shapes[i] for i in g.alone]}")


def add_own(sync, step: int, layout: list[Member], own: torch.Tensor) -> None:
    """e' ← e' + Δ̂_r, Δ̂_r read from this rank's own row `own` [1, payload bytes] as every
    receiver reads it (a message that missed its store round goes back into e)."""
    g = grouped_for(sync, layout)
    positions, values, _ = g.read(own)
    sync._unsent.index_add_(0, positions[0], values[0])     # positions distinct, as in `apply`
    xs = _views(sync._unsent, g, layout)
    for i in g.alone:
        xs[i].add_(alone_mean(sync.compressor, g.shapes[i], g.payloads[i], own, step, "mean").view(g.shapes[i]))


def _rejoin(sync, host, g: GroupedSparseLoCo, layout: list[Member], anchors) -> None:
    """`PeriodicAveraging._rejoin` of every tensor: float32 and other dtypes by `_rejoin_all`
    first (it reads θ_s), then each narrow dtype through its scratch."""
    k, params = sync._dtypes, [m.param for m in layout]
    slots = slots_of(layout)
    if k.wide or k.other:
        host._rejoin_all(_pick(slots, k.wide) + _pick(slots, k.other))
    for d, members in k.narrow.items():
        low, lows = k.low[d], k.lows[d]
        if host.delay == 1:                                  # θ ← θ₀
            torch._foreach_copy_(_pick(params, members), _pick(anchors, members))
            continue
        # θ − θ_s + θ₀ in float32 (θ, θ₀ widened exactly), rounded once to θ's dtype
        work = k.work(host._launched)                       # θ_s itself with one narrow dtype: read for the last time
        torch._foreach_copy_(_pick(lows, members), _pick(params, members))
        torch.sub(low, host._launched, out=work)
        torch._foreach_copy_(_pick(lows, members), _pick(anchors, members))
        work.add_(low)
        low.copy_(work)
        torch._foreach_copy_(_pick(params, members), _pick(lows, members))
