"""The periodic methods' outer step over flat buffers: Δ = θ − θ₀ into a flat float32 delta,
and the Nesterov outer update of every parameter as grouped ops, bf16 parameters included.

torch's `_foreach_*` ops loop tensor by tensor over mixed dtypes on CUDA, so parameters of a
low-precision dtype meet the float32 buffers through one flat buffer of their own dtype:
one same-dtype foreach copy in, one whole-buffer cast. Every result is bit for bit the
per-tensor arithmetic (float32 subtraction of exact values; h rounded to θ's dtype once).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .flat import Span, same_place


def low_dtype(tensors: list[torch.Tensor]):
    """The one dtype other than float32 among `tensors` (bf16 training), else None (none, or
    several: those go tensor by tensor)."""
    low = {t.dtype for t in tensors if t.dtype != torch.float32}
    return low.pop() if len(low) == 1 else None


def write_deltas(outs: list[torch.Tensor], params: list[torch.Tensor], anchors: list[torch.Tensor]) -> None:
    """Δ = θ − θ₀ of every parameter into `outs` (float32, contiguous, each its param's shape),
    each in float32 (exact for bf16 θ), as two grouped ops."""
    torch._foreach_copy_(outs, params)
    torch._foreach_sub_(outs, anchors)


class OuterFlats(NamedTuple):
    """Flat buffers for `nesterov_outer_all_` with low-precision anchors: Δ̄ (the parts are
    views of it), h (float32, its size) and `low` (its size, in the anchors' dtype)."""
    mean: torch.Tensor
    h: torch.Tensor
    low: torch.Tensor


def nesterov_outer_all_(xs: list[torch.Tensor], mean_deltas: list[torch.Tensor], bufs: list[torch.Tensor] | None,
                        lr: float, momentum: float, skip: torch.Tensor | None = None,
                        flats: OuterFlats | None = None) -> None:
    """`ops.nesterov_outer_` of every parameter with g = −Δ̄, as grouped ops with the same
    results: g = −Δ̄;  b ← μ b + g;  x ← x − η (g + μ b) (b None or μ = 0: x ← x − η g).
    Negation is exact and rounding symmetric, so the signs are folded in: b ← μ b − Δ̄,
    h = Δ̄ − μ b = −(g + μ b), x ← x + η h, bit for bit the same as with g.
    `skip` (0-dim bool on the device; Δ̄ must then be 0): b and x stay as they are.
    A low-precision x takes h rounded to its dtype (as per tensor): with `flats`, h lives in
    one flat buffer and is rounded in one copy, since torch's foreach ops loop tensor by
    tensor over mixed dtypes."""
    hs, flat = mean_deltas, None if flats is None else flats.mean
    if bufs is not None and momentum:
        # b ← μ b   (μ ← 1 where skip)
        torch._foreach_mul_(bufs, momentum if skip is None else torch.where(skip, 1.0, momentum))
        torch._foreach_sub_(bufs, mean_deltas)                  # b ← μ b − Δ̄
        if flats is None:
            hs = torch._foreach_sub(mean_deltas, bufs, alpha=momentum)   # h = Δ̄ − μ b
        else:                                                   # the same, into a flat h laid out like Δ̄
            flats.h.copy_(flats.mean)
            hs = [same_place(d, flats.mean, flats.h) for d in mean_deltas]
            torch._foreach_sub_(hs, bufs, alpha=momentum)
            flat = flats.h
        if skip is not None:
            torch._foreach_mul_(hs, skip.logical_not().to(torch.float32))   # h ← 0 where skip
    same = [i for i, x in enumerate(xs) if x.dtype == hs[i].dtype]
    if same:
        torch._foreach_add_([xs[i] for i in same], [hs[i] for i in same], alpha=lr)
    low = [i for i, x in enumerate(xs) if x.dtype != hs[i].dtype]
    if low and flats is not None and all(xs[i].dtype == flats.low.dtype for i in low):
        rounded = flats.low.copy_(flat)                         # every h rounded to x's dtype in one copy
        torch._foreach_add_([xs[i] for i in low], [same_place(hs[i], flat, rounded) for i in low], alpha=lr)
        return
    for i in low:                                               # rounded to x's dtype first, as per tensor
        xs[i].add_(hs[i].to(xs[i].dtype), alpha=lr)


def write_deltas_flat(x: torch.Tensor, places: list[Span], params: list[torch.Tensor], anchors: list[torch.Tensor],
                      low: torch.Tensor | None) -> None:
    """Δ = θ − θ₀ of every parameter into its span of x (float32). With `low` (a flat buffer of
    x's size in the one low-precision dtype among `params`), those parameters go through it:
    θ in (one same-dtype foreach copy), x ← θ widened, θ₀ in (0 in the other spans),
    x ← x − θ₀ widened: the same float32 subtraction of exact values as per tensor."""
    narrow = [] if low is None else [i for i, p in enumerate(params)
                                     if p.dtype == low.dtype and anchors[i].dtype == low.dtype]
    if not narrow:
        write_deltas([at.of(x).view(p.shape) for at, p in zip(places, params)], params, anchors)
        return
    taken = set(narrow)
    wide = [i for i in range(len(params)) if i not in taken]
    spans_low = [places[i].of(low).view(params[i].shape) for i in narrow]
    torch._foreach_copy_(spans_low, [params[i] for i in narrow])
    x.copy_(low)                                                # θ (the other spans: written below)
    torch._foreach_copy_(spans_low, [anchors[i] for i in narrow])
    if wide:
        torch._foreach_zero_([places[i].of(low) for i in wide])
    x.sub_(low)                                                 # θ − θ₀ in float32
    if wide:
        write_deltas([places[i].of(x).view(params[i].shape) for i in wide], [params[i] for i in wide],
                     [anchors[i] for i in wide])
