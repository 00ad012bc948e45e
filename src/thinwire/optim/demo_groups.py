"""DeMo's grouped hot path: the parameters of one chunk shape as one flat momentum, one
batched transform, one top-k, one pack and one decode per group (`thinwire.compress.chunk_group`).

The same equations as the per-tensor path in `thinwire.optim.demo` (its module docstring):

    T(M) ← β T(M) + w T(g)          one GEMM over the group, one batched GEMM per band (C_j)
    Q_i = Top-k per chunk of T(M)   one top-k over every chunk of the group
    T(M) ← T(M) − α Q̂_i            one index_add_ (indices unique, no two writes meet)
    Δ = T⁻¹(mean_j Q̂_j)            one index_add_ per rank, in rank order, then one inverse transform
    θ ← θ(1 − ηλ) − η φ(Δ)          `_foreach_mul_`, one sign_ over the group, `_foreach_add_`

A group is the parameters of one param group with one chunk shape h × w (`geometry`; its
members ordered by band, the tensors of one column count C together, and tensors of one-row
chunks one band whatever their widths) that keep their momentum as transform coefficients
(momentum_domain 'auto'/'transform' with 'dct' or 'identity'), are float32, bfloat16 or
float16 (one dtype per group) and not sharded, step with base 'signum' or 'sgd', and are
`groupable` (no padded columns; whole bytes per chunk). The others take the per-tensor path.

A bf16 or fp16 group keeps its momentum and Δ in float32, as the per-tensor path does, and
rounds where that path rounds: its gradients come in through one flat buffer of their dtype
and one exact widening copy (g is exact in float32), and φ(Δ) is rounded to the parameters'
dtype in one copy before `_foreach_add_` (the per-tensor path's `delta.to(p.dtype)` for
'sgd'; for 'signum' sign(Δ) ∈ {−1, 0, 1} is exact in any dtype), so every `_foreach_*` op
sees one dtype and stays one fused launch. The factors stay float32, as in the per-tensor
path's float32 + bf16 ops: 1 − ηλ multiplies as a float32 0-dim tensor (CPU's fp16
`_foreach_mul_` by a Python number rounds the number to fp16), and on CPU, whose bf16/fp16
`add_` rounds α = −η to that dtype (a GPU's does not), sign(Δ) is added as
addcmul(θ, sign, 1, α) (`_add_signs`).
Each member's `state[p]["momentum"]` is a view [R_i, C_i] of its group's flat momentum, so
`state_dict` / `load_state_dict` see the per-parameter tensors they always did (a loaded one
is copied into the group's buffer at the next step).

Same arithmetic as the per-tensor path, bit for bit on CPU (tests/optim/test_demo_groups.py):
the GEMMs see the same [·, w] × [w, w] and [h, h] × [h, C] products, only more of them per
call; the sums over ranks run in rank order as before. One exception on CPU: MKL computes the
last rows % 4 of a GEMM under 12 rows with other kernels, so a tensor of one-row chunks with
fewer than 12 chunk rows (a bias of 64 with chunk 64, say) rounds its transform differently
alone than in its group's taller GEMM (float rounding only; the group's results do not
depend on which other tensors it holds once it has 12 rows). On a GPU, a GEMM over more rows can
pick another kernel (another summation order over w or h: float rounding only), and top-k
over more rows another algorithm, which may break ties between equal magnitudes otherwise.
"""

from __future__ import annotations

import torch

from ..compress.chunk_group import ChunkGroup, geometry, groupable


GROUP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def eligible(slot, momentum_in_transform) -> bool:
    """Whether a `demo.Slot` can join a group (module docstring)."""
    group, p, comp = slot.group, slot.param, slot.comp
    return (momentum_in_transform(group) and group["transform"] in ("dct", "identity") and p is slot.key
            and p.dtype in GROUP_DTYPES and group["base"] in ("signum", "sgd") and groupable(comp, p.shape))


class Group:
    """One group: its `ChunkGroup`, its members (indices into the slots, those of one band
    together), its flat momentum (the bands' images end to end) and byte scratch, lookahead's copy of the momentum (made on first use), and for
    a bf16/fp16 group `low`, a flat buffer of the group's image in the parameters' dtype (the
    gradients on their way in, φ(Δ) on its way out)."""

    def __init__(self, slots, members: list[int], nbytes: int):
        first = slots[members[0]]
        device = first.param.device
        self.members, self.hyper = members, first.group
        self.chunks = ChunkGroup(first.comp, [slots[i].param.shape for i in members],
                                 [slots[i].offset for i in members], nbytes, device)
        self.momentum = torch.zeros(self.chunks.numel, device=device)
        self.packed = torch.empty(self.chunks.group_nbytes, dtype=torch.uint8, device=device)
        self.ahead: torch.Tensor | None = None
        self.dtype = first.param.dtype
        self.zeros = torch.zeros(max(self.chunks.sizes), dtype=self.dtype, device=device)
        self.low = (None if self.dtype == torch.float32 else
                    torch.empty(self.momentum.numel(), dtype=self.dtype, device=device))
        self.decay = torch.ones((), device=device)          # 1 − ηλ as a float32 tensor, for `low` groups
        self.zero = torch.zeros((), device=device)          # what a flagged step's gradients are taken as
        self.ones: torch.Tensor | None = None               # `_add_signs` on CPU
        self.views = self.chunks.views(self.momentum)       # each member's [R_i, C_i] of the momentum
        # each chunk's member (the order of `ChunkGroup.received`'s chunks): the median-norm clip's segments
        self.chunk_counts = torch.tensor(self.chunks.chunks)
        self.chunk_tensor = torch.repeat_interleave(torch.arange(len(members)), self.chunk_counts).to(device)
        self.chunk_counts = self.chunk_counts.to(device)
        plans = [first.comp.plan(slots[i].param.shape) for i in members]
        self.padded = [(view, plan) for view, plan in zip(self.views, plans) if plan.padded]
        self._crops: dict[tuple, list[torch.Tensor]] = {}

    def crops(self, image: torch.Tensor) -> list[torch.Tensor]:
        """`ChunkGroup.crops` of `image`, kept for the few buffers a step passes (scratch, `low`,
        `ahead`): made once instead of two views per member per step. The kept views hold their
        storage, so an address seen again is the same buffer."""
        key = (image.data_ptr(), image.dtype, tuple(image.shape), image.stride())
        crops = self._crops.get(key)
        if crops is None:
            if len(self._crops) >= 4:
                self._crops.clear()
            crops = self._crops[key] = self.chunks.crops(image)
        return crops

    def drop_padding(self, step: int, where: torch.Tensor | None = None) -> None:
        """What landed in the padding of a padded member's image is dropped; with `where` (0-dim
        bool on the device) only where it is set, the image left bit for bit as it was
        elsewhere (T(P·T⁻¹(·)) is a projection, but in floating point not an exact one). A
        group pads rows only (`groupable`), so only the last block row [h, C_i] changes."""
        for view, plan in self.padded:
            strip = view[plan.padded_rows - plan.chunk_rows:]
            kept = None if where is None else strip.clone()
            self.chunks.comp.transform.zero_padding_(view, plan, step)
            if kept is not None:
                torch.where(where, strip, kept, out=strip)


class Groups:
    """The layout's groups and the slots left to the per-tensor path (`rest`)."""

    def __init__(self, slots, nbytes: int, momentum_in_transform):
        by_key: dict[tuple, list[int]] = {}
        self.rest = []
        for i, s in enumerate(slots):
            if eligible(s, momentum_in_transform):
                key = (id(s.group), id(s.comp), s.param.device, s.param.dtype, geometry(s.comp, s.param.shape)[:2])
                by_key.setdefault(key, []).append(i)
            else:
                self.rest.append(i)
        # a group's members by band (their C), in layout order within one: one band per distinct C
        band = {i: geometry(slots[i].comp, slots[i].param.shape)[2] for members in by_key.values() for i in members}
        self.groups = [Group(slots, sorted(members, key=lambda i: (band[i], i)), nbytes) for members in by_key.values()]

    @property
    def numel(self) -> int:
        """Scratch elements the largest group needs."""
        return max((g.momentum.numel() for g in self.groups), default=1)

    def adopt(self, state, slots) -> None:
        """Each member's state["momentum"] a view of its group's buffer; a tensor put there by
        load_state_dict (or the first step's zeros) is copied in first."""
        for g in self.groups:
            for i, view in zip(g.members, g.views):
                m = state[slots[i].key]["momentum"]
                if m.data_ptr() != view.data_ptr() or m.shape != view.shape:
                    view.copy_(m)
                    state[slots[i].key]["momentum"] = view


def gradients_into(g: Group, slots, x: torch.Tensor, nonfinite: torch.Tensor | None = None) -> None:
    """The members' gradients into x (flat, ΣR_i·C_i), image by image: zeros for a missing
    gradient and below a member's rows (its row padding, which the transform must see as 0).
    `nonfinite` (0-dim bool on the device, the envelope's flag of this rank's gradients): when
    set, every gradient is taken as zero, as a missing one is, with no host read."""
    pieces = []
    for i, size in zip(g.members, g.chunks.sizes):
        p = slots[i].param
        if p.grad is None:
            pieces.append(g.zeros[:size])
            continue
        pieces.append(p.grad.reshape(-1))
        if size > p.numel():
            pieces.append(g.zeros[: size - p.numel()])
    if g.low is None:
        torch.cat(pieces, out=x[: g.momentum.numel()])
    else:                                                    # one same-dtype cat, one exact widening copy
        x[: g.momentum.numel()].copy_(torch.cat(pieces, out=g.low))
    if nonfinite is not None:                                # one pass; a CPU's masked_fill_ takes 1.4x as long
        torch.where(nonfinite, g.zero, x[: g.momentum.numel()], out=x[: g.momentum.numel()])


def encode(g: Group, slots, step: int, payload: torch.Tensor, scratch, weight: float, ahead: bool,
           nonfinite: torch.Tensor | None = None) -> None:
    """T(M) ← βT(M) + wT(g); the top-k of every chunk into the message; T(M) ← T(M) − αQ̂_i.
    g is taken as zero when `nonfinite` is set (`gradients_into`)."""
    a, b = scratch
    gradients_into(g, slots, a, nonfinite)
    # T(M) ← βT(M) + wT(g): one GEMM over the stacked images, one batched GEMM per band over its row blocks
    g.chunks.forward(a[: g.chunks.numel], g.momentum, step, b, beta=g.hyper["beta"], alpha=weight)
    positions, sent = g.chunks.send(g.momentum, payload, g.packed, scratch=a)
    if ahead:                                                # lookahead='momentum': M before the subtraction
        if g.ahead is None:
            g.ahead = torch.empty_like(g.momentum)
        g.ahead.copy_(g.momentum)
    # T(M) ← T(M) − α Q̂_i: positions unique, so no two writes meet
    g.momentum.view(-1).index_add_(0, positions.view(-1), sent.view(-1), alpha=-g.hyper["alpha"])
    g.drop_padding(step)


def aggregate(g: Group, positions: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
              counts: torch.Tensor) -> torch.Tensor:
    """The group's image of Σ_j Q̂_j / W ('mean') or / (ranks that sent each coefficient)
    ('senders'), ranks summed in rank order (one index_add_ each: no atomics across ranks)."""
    image = out[: g.chunks.numel].zero_()
    for r in range(positions.shape[0]):
        image.index_add_(0, positions[r].view(-1), values[r].view(-1))
    if g.hyper["aggregate"] == "mean":
        return image.div_(positions.shape[0])
    count = counts[: g.chunks.numel].zero_()
    for r in range(positions.shape[0]):
        count.index_add_(0, positions[r].view(-1), torch.ones_like(values[r]).view(-1))
    return image.div_(count.clamp_(min=1))


def put_back(g: Group, slots, step: int, positions: torch.Tensor, values: torch.Tensor, skip: torch.Tensor) -> None:
    """Where `skip` (0-dim bool on the device) is set, a step that is not applied gives back
    what `encode` took: T(M) ← T(M) + α Q̂_i (positions, values: this rank's own message, as
    decoded); where it is not, T(M) is left exactly as it is (−0.0 is added)."""
    # T(M) ← T(M) + α·(skip ? Q̂_i : −0)
    taken = torch.where(skip, values.reshape(-1), -0.0)
    g.momentum.view(-1).index_add_(0, positions.reshape(-1), taken, alpha=g.hyper["alpha"])
    g.drop_padding(step, where=skip)


def step_params(g: Group, slots, delta: torch.Tensor, present: list[bool] | None = None,
                skip: torch.Tensor | None = None) -> None:
    """θ ← θ(1 − ηλ), then θ ← θ − η φ(Δ) (`demo.step_param`) for the members (those `present`),
    with one op per group: Δ the group's image, padding rows included. `skip` (0-dim bool on
    the device): where set, θ stays exactly as it is (Δ ← 0, 1 − ηλ ← 1)."""
    hyper = g.hyper
    keep = [j for j, i in enumerate(g.members) if present is None or present[i]]
    params = [slots[g.members[j]].param for j in keep]
    if not params:
        return
    if skip is not None:
        delta.masked_fill_(skip, 0.0)                       # θ − η φ(0) = θ (adds −0.0)
    if hyper["base"] != "sgd":                               # signum: sign over the whole image at once
        delta.sign_()
    if g.low is not None:                                    # φ(Δ) in θ's dtype (module docstring)
        delta = g.low.view(delta.shape).copy_(delta)
    crops = g.crops(delta)
    crops = [crops[j] for j in keep]
    if hyper["weight_decay"]:
        decay = 1.0 - hyper["lr"] * hyper["weight_decay"]
        if skip is not None:
            decay = torch.where(skip, 1.0, decay)
        elif g.low is not None:                              # a float32 factor (module docstring)
            decay = g.decay.fill_(decay)
        torch._foreach_mul_(params, decay)
    if hyper["base"] == "sgd":
        alpha = 1.0 if hyper["momentum_form"] == "reference" else hyper["lr"]
        torch._foreach_add_(params, crops, alpha=-alpha)
    else:
        _add_signs(g, params, crops, keep, -hyper["lr"])


def _add_signs(g: Group, params: list[torch.Tensor], signs: list[torch.Tensor], keep: list[int], alpha: float) -> None:
    """θ ← θ + α sign(Δ), one fused op, α taken in float32 as the per-tensor path's float32
    sign does. CPU's bf16/fp16 `add_` rounds α to the tensors' dtype first (a GPU's does not),
    so there a low-precision group takes the same sum as addcmul(θ, sign, 1, α)."""
    if g.low is None or g.low.device.type != "cpu":
        torch._foreach_add_(params, signs, alpha=alpha)
        return
    if g.ones is None:
        g.ones = torch.ones_like(g.low)
    ones = g.crops(g.ones)
    torch._foreach_addcmul_(params, signs, [ones[j] for j in keep], value=alpha)

