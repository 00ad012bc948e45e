"""SparseLoCo's sync on the grouped layout: the equations of `thinwire.optim.sparseloco` (its
module docstring) with a number of operations that does not grow with the parameter count.

    Δ = θ₀ − θ;  e = β e + Δ        `_foreach_copy_`, `_foreach_sub_`, `_foreach_add_` into the
                                    flat e' buffer (tensor by tensor in layout order, as before)
    Δ̂_r = Q(TopK(e))               `GroupedSparseLoCo`: one top-k per chunk shape, one 2-bit
                                    quantization of every kept value (levels per tensor), one
                                    packing per stream, one scatter into the message
    e' = e − Δ̂_r                   one index_add_ of every kept value into the flat e'
    θ ← θ₀ − c α Δ̂_r (eager)       in the flat θ_s buffer: `_foreach_copy_`, one index_add_,
                                    `_foreach_copy_` back into the parameters
    Δ̄ = (1/R) Σ_r Δ̂_r              one read of every rank's bytes, checked on the device and
                                    read once; one index_add_ per rank, in rank order, into a
                                    flat Δ̄; one division
    e ← e';  θ₀ ← θ₀ − α Δ̄;  θ ← θ₀ (+ θ − θ_s)   `_foreach_*` ops (`PeriodicAveraging._rejoin_all`)

A parameter joins when it is float32 and `sparseloco_grouped.joins` its shape ('identity' top-k,
'2bit' values; padded chunks too); the others go tensor by tensor as on the per-tensor path
(`SparseLoCo.grouped = False` sends every parameter there: the reference, bit for bit the
same on CPU, tests/optim/test_sparseloco_groups.py). On a GPU, a top-k over more rows may break
ties between equal magnitudes otherwise, and `_foreach_add_` may fuse β e + Δ into one rounding.
"""

from __future__ import annotations

import torch

from ..compress.sparseloco_flat import alone_mean
from ..compress.sparseloco_grouped import GroupedSparseLoCo
from ..compress.sparseloco_topk import Sent
from ..compress.topk import raise_malformed
from ..wire import checks
from .base import Member
from .periodic import _reuse, slots_of


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


def grouped_for(opt, layout: list[Member]) -> GroupedSparseLoCo:
    """The layout's grouped compressor, rebuilt when its shapes, dtypes or device change."""
    key = tuple((tuple(m.param.shape), m.param.dtype) for m in layout), layout[0].param.device
    if opt._grouped_key != key:
        eligible = [m.param.dtype == torch.float32 for m in layout]
        opt._grouped = GroupedSparseLoCo(opt.compressor, [m.param.shape for m in layout], key[1], eligible)
        opt._grouped_key = key
    return opt._grouped


def _views(flat: torch.Tensor, g: GroupedSparseLoCo, layout: list[Member]) -> list[torch.Tensor]:
    return [flat[at: at + m.param.numel()].view(m.param.shape) for at, m in zip(g.offsets, layout)]


def encode(opt, step: int, layout: list[Member], payload: torch.Tensor) -> None:
    """The sync's message and e' aside (and with delay > 1: θ_s, the eager jump), grouped."""
    g, device = grouped_for(opt, layout), layout[0].param.device
    n = g.offsets[-1] + layout[-1].param.numel()
    opt._unsent, opt._mean = _reuse(opt._unsent, n, device), _reuse(opt._mean, n, device)
    states, params = [opt.state[m.key] for m in layout], [m.param for m in layout]
    xs, anchors = _views(opt._unsent, g, layout), [st["anchor"] for st in states]
    # Δ = θ₀ − θ   (float32, exact for bf16 θ)
    torch._foreach_copy_(xs, anchors)
    torch._foreach_sub_(xs, params)
    # e = β e + Δ
    torch._foreach_add_(xs, [st["error"] for st in states], alpha=opt.error_decay)
    g.select(opt._unsent, opt._mean)                        # the Δ̄ scratch as the stage: free until landing
    positions, sent = g.encode(opt._unsent, payload)
    # e' = e − Δ̂, committed when the sync lands: a + (−1)·v is a − v exactly, positions distinct
    opt._unsent.index_add_(0, positions, sent, alpha=-1.0)
    if opt.delay > 1:
        opt._launched = _reuse(opt._launched, n, device)
        if opt._eager_now:
            opt._x = _reuse(opt._x, n, device)
            torch._foreach_copy_(_views(opt._x, g, layout), params)   # θ before the jump: a sync not made puts it back
    for i in g.alone:                                       # tensor by tensor (their Sent shares a scratch)
        _alone(opt, step, g, layout[i].param, anchors[i], xs[i], i, payload)
    if opt.delay > 1:
        _launch(opt, g, layout, positions, sent)
    opt._own_sent, opt._eager_jumped = None, opt._eager_now


def _alone(opt, step: int, g: GroupedSparseLoCo, p, anchor, x, i: int, payload) -> None:
    """A tensor that cannot join: its Δ̂ into the message, e', and θ_s / the jump, as per tensor."""
    sent = opt.compressor.encode_sent(x, g.payloads[i].of(payload), step)
    _subtract_sent(x, sent)                                 # e' = e − Δ̂
    if opt._eager_now:
        # θ ← θ₀ − c α Δ̂_r, in the parameter's dtype
        p.copy_(anchor)
        _subtract_sent(p, sent, opt.eager_scale * opt.outer_lr)
    if opt.delay > 1:
        kept = opt._launched[g.offsets[i]: g.offsets[i] + p.numel()].view(p.shape)
        kept.copy_(p)                                       # θ_s


def _launch(opt, g: GroupedSparseLoCo, layout: list[Member], positions, sent) -> None:
    """θ_s of the joined tensors kept until the sync lands; with `eager`, the jump first."""
    joined = g.tensors
    if not joined:
        return
    params, launched = [layout[i].param for i in joined], _views(opt._launched, g, layout)
    launched = [launched[i] for i in joined]
    if not opt._eager_now:
        torch._foreach_copy_(launched, params)              # θ_s = θ
        return
    scale = opt.eager_scale * opt.outer_lr
    # θ_s = θ₀ − c α Δ̂_r in the flat θ_s, then θ ← θ_s
    torch._foreach_copy_(launched, [opt.state[layout[i].key]["anchor"] for i in joined])
    if scale == 1.0:                                        # a + (−1)·v: exact, as a + (−v)
        opt._launched.index_add_(0, positions, sent, alpha=-1.0)
    else:                                                   # the product rounded first, as per tensor
        opt._launched.index_add_(0, positions, sent.mul(scale).neg_())
    torch._foreach_copy_(params, launched)


def read(opt, layout: list[Member], rows: torch.Tensor) -> tuple:
    """Every rank's row [R, payload bytes] of the joined tensors: (positions [R, K], values
    [R, K], device flags of malformed bytes)."""
    return grouped_for(opt, layout).read(rows)


def apply(opt, step: int, layout: list[Member], rows: torch.Tensor, arrived: tuple | None = None) -> None:
    """Δ̄ from every rank's row (rank order), then e ← e', θ₀ ← θ₀ − α Δ̄, θ ← θ₀ (+ θ − θ_s).
    arrived: `read`'s answer, checked by the envelope's one host read; without it the rows are
    read and checked here (one host read), before anything moves."""
    g, device = grouped_for(opt, layout), layout[0].param.device
    if arrived is None:
        arrived = g.read(rows)
        raise_malformed(checks.any_of(arrived[2]), f" at step {step}")
    positions, values, _ = arrived
    n = opt._unsent.numel()
    mean = opt._mean = _reuse(opt._mean, n, device)
    means = _views(mean, g, layout)
    mean.zero_()
    for r in range(rows.shape[0]):                          # Σ_r Δ̂_r in rank order: no atomics across ranks
        mean.index_add_(0, positions[r], values[r])
    if opt.aggregate == "mean":
        mean.div_(rows.shape[0])
    else:                                                   # 'senders': each element over the ranks that sent it
        counts = opt.compressor.scratch(n, device)[:n].zero_()
        padding = g.received_padding                        # a value in a padding counts 0 at position 0
        for r in range(rows.shape[0]):
            counts.index_add_(0, positions[r], torch.ones_like(values[r]) if padding is None else (~padding[r]).float())
        mean.div_(counts.clamp_(min=1))
    for i in g.alone:
        means[i].copy_(alone_mean(opt.compressor, g.shapes[i], g.payloads[i], rows, step, opt.aggregate).view(g.shapes[i]))
    states = [opt.state[m.key] for m in layout]
    # e ← e'
    torch._foreach_copy_([st["error"] for st in states], _views(opt._unsent, g, layout))
    if opt.outer_lr != 1.0:                                 # × 1 is exact: skipped
        mean.mul_(opt.outer_lr)
    # θ₀ ← θ₀ − α Δ̄
    same = [i for i, st in enumerate(states) if st["anchor"].dtype == torch.float32]
    if same:
        torch._foreach_sub_([states[i]["anchor"] for i in same], [means[i] for i in same])
    for i, st in enumerate(states):
        if st["anchor"].dtype != torch.float32:             # rounded to its dtype first, as per tensor
            st["anchor"].sub_(means[i].to(st["anchor"].dtype))
    # θ ← θ₀   (delay > 1: θ ← θ₀ + (θ − θ_s))
    opt._rejoin_all(slots_of(layout))
