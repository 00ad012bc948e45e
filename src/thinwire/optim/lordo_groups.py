"""LoRDO's grouped hot path: the parameters of one param group, shape and dtype as one stack,
each line of `thinwire.optim.lordo`'s equations one operation over the stack, or over every
stack at once where the line is elementwise.

    Ĝ = G / max(1, ‖G‖_F / ρ)                  per stack: one stack of the gradients, one
                                                 batched norm (‖G_i‖ of each member)
    ĝ = P(Ĝ + E);  E ← Ĝ + E − P*(ĝ)           per stack: E += Ĝ, two `bmm`s, E −= lifted
    θ ← θ (1 − η λ)                             all stacks: one `_foreach_mul_` per dtype
    u, v, D                                      all stacks: `_foreach_*` per (β₁, β₂, ε, t)
    θ ← θ − η [ω P*(u / D) + (1 − ω) Ĝ / μ(D)]   per stack: one `bmm`, batched means,
                                                 `_foreach_add_` (full rank: `_foreach_addcdiv_`)
    Q_new = top-r of Δ̄;  u, v rotated           per stack: one batched SVD, three `bmm`s

A stack holds the low-rank (or full-rank) members of one param group with one shape, dtype
(float32, bfloat16, float16) and device, contiguous and not sharded, with the same basis
size and error feedback. Its state is one buffer per name ([n, ...]: 'exp_avg',
'exp_avg_sq', and 'Q', 'error' for low-rank ones); each member's `state[p][name]` is a view
of it, so `state_dict` / `load_state_dict` see the per-parameter tensors they always did (a
tensor put there by a load, or the first step's zeros, is copied in at the next step). The
others (FSDP2 shards, float64, strided parameters) take the per-tensor path; so, for one
step, does a stack whose members do not all have a gradient or a common step count.

A GPU step's launches then grow with the number of stacks (distinct shapes), not tensors,
and read nothing on the host: ‖G‖_F, the clip's scale and mean(D) stay on the device, and a
step under a skip flag (this rank's gradients not finite, `step_stacks_`; a sync's verdict,
`refresh_stack_`) keeps every value where it is set with masks and `torch.where`, unread.
Arithmetic: the equations' own, line by line as the per-tensor path computes them (the same
`_foreach_*` formulas as `ops.adam_moments_` / `ops.adam_denominator`); a batched norm, mean
or GEMM may sum in another order than one matrix at a time (float rounding only; on CPU the
two paths agreed bit for bit in tests/optim/test_lordo_groups.py). bf16/fp16 parameters
round each update term to their dtype where the per-tensor path does (`add_to_params_`).
"""

from __future__ import annotations

import math

import torch

from ..ops import lowrank
from .shards import is_sharded

GROUP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = ("exp_avg", "exp_avg_sq", "Q", "error")


def signature(member, state: dict) -> tuple | None:
    """The stack `member` joins (None: the per-tensor path)."""
    group, p, key = member
    if is_sharded(key) or p.dtype not in GROUP_DTYPES or not p.is_contiguous() or "exp_avg" not in state:
        return None
    q = state.get("Q")
    low = None if q is None else (tuple(q.shape), "error" in state)
    return id(group), tuple(p.shape), p.dtype, p.device, low


class Stack:
    """Members (indices into the layout) of one signature, with their state stacked."""

    def __init__(self, layout, members: list[int], states: list[dict]):
        first = layout[members[0]]
        self.members, self.group = members, first.group
        self.shape, self.dtype = tuple(first.param.shape), first.param.dtype
        self.low_rank = "Q" in states[0]
        self.matrix = (self.shape[0], math.prod(self.shape[1:])) if self.low_rank else None
        self.where = lowrank.side(self.matrix) if self.low_rank else None
        device, n = first.param.device, len(members)
        self.buffers = {name: torch.zeros((n, *states[0][name].shape), dtype=states[0][name].dtype, device=device)
                        for name in NAMES if name in states[0]}
        self.views = {name: buf.unbind(0) for name, buf in self.buffers.items()}
        self._factor: tuple[float, torch.Tensor] | None = None

    def factor(self, value: float) -> torch.Tensor:
        """`value` as a float32 0-dim tensor on the stack's device, made once per value."""
        if self._factor is None or self._factor[0] != value:
            device = next(iter(self.buffers.values())).device
            self._factor = (value, torch.full((), value, device=device))
        return self._factor[1]

    def adopt(self, states: list[dict]) -> None:
        """Each member's state a view of the stack's buffers (another tensor there copied in)."""
        for name, views in self.views.items():
            for state, view in zip(states, views):
                if state[name] is not view:
                    view.copy_(state[name])
                    state[name] = view


class Stacks:
    """The layout's stacks and the indices left to the per-tensor path (`rest`)."""

    def __init__(self, layout, states: list[dict], signatures: list):
        by_key: dict[tuple, list[int]] = {}
        self.rest = []
        for i, sig in enumerate(signatures):
            if sig is None:
                self.rest.append(i)
            else:
                by_key.setdefault(sig, []).append(i)
        self.stacks = [Stack(layout, members, [states[i] for i in members]) for members in by_key.values()]


def stacked_gradients(grads: list[torch.Tensor], dtype) -> torch.Tensor:
    """The gradients as one float32 [n, ...] tensor: one stack (low precision: in their dtype,
    then one exact widening copy, since a cat across dtypes is a loop on a GPU)."""
    if dtype == torch.float32:
        return torch.stack(grads)
    return torch.stack(grads).float()


def clip_(g: torch.Tensor, rho: float | None) -> None:
    """Ĝ_i = G_i / max(1, ‖G_i‖_F / ρ) for each member i of g [n, ...], in place, on the device
    (G_i itself below the threshold)."""
    if rho is None:
        return
    scale = torch.linalg.vector_norm(g.view(g.shape[0], -1), dim=1).div_(rho).clamp_(min=1.0)
    g.div_(scale.view(-1, *[1] * (g.dim() - 1)))


def full_rank_coefficient(mean: torch.Tensor, lr: float, omega: float) -> torch.Tensor:
    """−η (1 − ω) / mean(D), on the device (a tensor of means: one coefficient each)."""
    return mean.reciprocal().mul_(-lr * (1.0 - omega))


def add_to_params_(params: list[torch.Tensor], update: torch.Tensor, alpha: float = 1.0) -> None:
    """θ_i ← θ_i + α update_i for the stacked update [n, ...] (float32), in one `_foreach_add_`;
    low-precision θ take it rounded to their dtype first, as the per-tensor path does."""
    dtype = params[0].dtype
    if dtype != update.dtype:
        update = update.to(dtype)
    torch._foreach_add_(params, list(update.view(len(params), *params[0].shape).unbind(0)), alpha=alpha)


def commit_(skip: torch.Tensor | None, target: torch.Tensor, new: torch.Tensor) -> None:
    """target ← new; under `skip` (0-dim bool on the device) only where it is not set, unread."""
    if skip is not None:
        torch.where(skip, target, new, out=target)
    elif new is not target:
        target.copy_(new)


def zero_where_(skip: torch.Tensor | None, x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """x (a tensor of the step's own, written in place) set to `value` where `skip` is set."""
    return x if skip is None else x.masked_fill_(skip, value)


def step_stacks_(work: list[tuple[Stack, list[torch.Tensor], int]], skip: torch.Tensor | None = None) -> None:
    """One local step of every stack in `work`: (stack, its parameters, all with a gradient,
    their step count t). Per stack Ĝ, and E and ĝ for a low-rank one; then θ ← θ (1 − η λ), the
    moments and D of every stack at once (`_foreach_*`, one call per dtype or hyperparameter
    set); then each stack's update. `skip`: this rank's gradients are not finite (0-dim bool on
    the device); where set, Ĝ and ĝ are taken as zeros, the decay as 1, u and v are kept and
    the update terms are zeros, so θ, E, u and v keep their values; the same arithmetic where not."""
    images = [clipped_image(s, params, skip) for s, params, _ in work]
    decay_all_(work, skip)
    lows = [project_with_feedback_(s, g, skip) if s.low_rank else g for (s, _, _), g in zip(work, images)]
    denominators = moments_all_(work, lows, skip)
    for (s, params, t), g, d in zip(work, images, denominators):
        if s.low_rank:
            low_rank_update_(s, params, g, d, t, skip)
        else:
            full_rank_update_(s, params, d, t, skip)


def clipped_image(s: Stack, params: list[torch.Tensor], skip: torch.Tensor | None = None) -> torch.Tensor:
    """Ĝ of every member, float32 [n, ...] (low-rank stacks: [n, p, rest]); −0 where `skip`
    (E + (−0) is E bit for bit)."""
    g = stacked_gradients([p.grad for p in params], s.dtype)
    clip_(g, s.group["clip"])
    zero_where_(skip, g, -0.0)
    return g.view(len(params), *s.matrix) if s.low_rank else g


def decay_all_(work: list[tuple[Stack, list[torch.Tensor], int]], skip: torch.Tensor | None = None) -> None:
    """θ ← θ (1 − η λ) for every stack with weight decay, one `_foreach_mul_` per (factor, dtype);
    low precision (and `skip`: 1 where set) takes the factor as a float32 0-dim tensor, as `p.mul_`
    takes a Python float."""
    by_key: dict[tuple, tuple[Stack, list[torch.Tensor]]] = {}
    for s, params, _ in work:
        if s.group["weight_decay"]:
            decay = 1.0 - s.group["lr"] * s.group["weight_decay"]
            by_key.setdefault((decay, s.dtype, params[0].device), (s, []))[1].extend(params)
    for (decay, dtype, _), (s, params) in by_key.items():
        factor = decay if dtype == torch.float32 and skip is None else s.factor(decay)
        torch._foreach_mul_(params, factor if skip is None else torch.where(skip, 1.0, factor))


def moments_all_(work: list[tuple[Stack, list[torch.Tensor], int]], lows: list[torch.Tensor],
                 skip: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`ops.adam_moments_` and `ops.adam_denominator` of every stack (ĝ for low-rank ones, Ĝ
    for the others), one `_foreach_*` call per line and (β₁, β₂, ε, t): D of each stack.
    Where `skip` is set ĝ is 0 there: u's lerp goes to u itself and v's factor is 1, so both
    keep their values (u + w (u − u), v · 1 + 0) with no copy of them."""
    by_key: dict[tuple, list[int]] = {}
    for i, (s, _, t) in enumerate(work):
        by_key.setdefault((*s.group["betas"], s.group["eps"], t, lows[i].device), []).append(i)
    denominators: list[torch.Tensor | None] = [None] * len(work)
    for (beta1, beta2, eps, t, _), index in by_key.items():
        us, vs = [work[i][0].buffers["exp_avg"] for i in index], [work[i][0].buffers["exp_avg_sq"] for i in index]
        gs = [lows[i] for i in index]
        # u ← β₁ u + (1 − β₁) ĝ,  v ← β₂ v + (1 − β₂) ĝ²
        torch._foreach_lerp_(us, gs if skip is None else [torch.where(skip, u, g) for u, g in zip(us, gs)], 1 - beta1)
        torch._foreach_mul_(vs, beta2 if skip is None else torch.where(skip, 1.0, beta2))
        torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
        # D = √(v / (1 − β₂ᵗ)) + ε, as √v / √(1 − β₂ᵗ) + ε
        ds = torch._foreach_sqrt(vs)
        torch._foreach_div_(ds, math.sqrt(1.0 - beta2 ** t))
        torch._foreach_add_(ds, eps)
        for i, d in zip(index, ds):
            denominators[i] = d
    return denominators


def full_rank_update_(s: Stack, params: list[torch.Tensor], d: torch.Tensor, t: int,
                      skip: torch.Tensor | None = None) -> None:
    """θ ← θ − η u / ((1 − β₁ᵗ) D) for every member (`lordo_tensor.full_rank_step_`); u taken
    as 0 where `skip` (θ + (−0) is θ)."""
    u = s.buffers["exp_avg"] if skip is None else s.buffers["exp_avg"].masked_fill(skip, 0.0)
    if s.dtype != torch.float32:                      # u and D rounded to θ's dtype, as per tensor
        u, d = u.to(s.dtype), d.to(s.dtype)
    value = -s.group["lr"] / (1.0 - s.group["betas"][0] ** t)
    torch._foreach_addcdiv_(params, list(u.unbind(0)), list(d.unbind(0)), value=value)


def project(x: torch.Tensor, q: torch.Tensor, where: str) -> torch.Tensor:
    """`lowrank.project` of each matrix of the stack: X Q (right) or Qᵀ X (left)."""
    return torch.bmm(x, q) if where == lowrank.RIGHT else torch.bmm(q.mT, x)


def lift(g: torch.Tensor, q: torch.Tensor, where: str, out: torch.Tensor) -> torch.Tensor:
    """`lowrank.lift` of each matrix of the stack into `out`: g Qᵀ (right) or Q g (left)."""
    return torch.bmm(g, q.mT, out=out) if where == lowrank.RIGHT else torch.bmm(q, g, out=out)


def project_with_feedback_(s: Stack, g: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
    """ĝ = P(Ĝ + E) of every member, and E ← Ĝ + E − P*(ĝ) (`lordo_tensor.low_rank_step_`);
    ĝ = 0 where `skip` (Ĝ is −0 there: E keeps its value)."""
    q, error = s.buffers["Q"], s.buffers.get("error")
    # X = Ĝ + E, in E's buffer (E ← X − P*(ĝ) below)   (error_feedback=False: X = Ĝ)
    fed = g if error is None else error.add_(g)
    # ĝ = P(X)
    low = zero_where_(skip, project(fed, q, s.where))
    if error is not None:
        # E ← X − P*(ĝ)
        error.sub_(lift(low, q, s.where, out=torch.empty_like(g)))
    return low


def low_rank_update_(s: Stack, params: list[torch.Tensor], g: torch.Tensor, d: torch.Tensor, t: int,
                     skip: torch.Tensor | None = None) -> None:
    """θ ← θ − η [ω P*(u / ((1 − β₁ᵗ) D)) + (1 − ω) Ĝ / mean(D)] for every member, g = Ĝ
    [n, p, rest] (`lordo_tensor.low_rank_step_`); weight decay already applied. Where `skip`,
    u / D and the coefficient are zeros (whatever D is), so both terms add zeros."""
    lr, omega, work = s.group["lr"], s.group["omega"], torch.empty_like(g)
    if omega > 0.0:
        # θ ← θ − η ω P*(u / ((1 − β₁ᵗ) D))
        scaled = lift(zero_where_(skip, s.buffers["exp_avg"] / d), s.buffers["Q"], s.where, out=work)
        add_to_params_(params, scaled, alpha=-lr * omega / (1.0 - s.group["betas"][0] ** t))
    if omega < 1.0:
        # θ ← θ − η (1 − ω) Ĝ / mean(D)
        coefficient = zero_where_(skip, full_rank_coefficient(d.mean(dim=(1, 2)), lr, omega))
        add_to_params_(params, torch.mul(g, coefficient.view(-1, 1, 1), out=work))


def refresh_stack_(s: Stack, deltas: list[torch.Tensor], skip: torch.Tensor | None = None) -> None:
    """Q_new = top-r singular vectors of each member's Δ̄ (flat float32), u and v rotated from
    Q into Q_new (`lowrank.top_singular_basis`, `lowrank.rotate_moments`): one stack of the
    deltas, one batched SVD, three `bmm`s, written into the stack's buffers (not where `skip`)."""
    q, u, v = s.buffers["Q"], s.buffers["exp_avg"], s.buffers["exp_avg_sq"]
    delta = torch.stack([d.view(s.matrix) for d in deltas])
    left, _, right = torch.linalg.svd(delta, full_matrices=False)
    r = q.shape[2]
    q_new = right[:, :r].mT if s.where == lowrank.RIGHT else left[:, :, :r]
    c = torch.bmm(q.mT, q_new)                        # C = Q_oldᵀ Q_new, r × r
    c2 = c * c
    if s.where == lowrank.RIGHT:                      # u ← u C,  v ← v (C ∘ C)
        u_new, v_new = torch.bmm(u, c), torch.bmm(v, c2)
    else:                                             # u ← Cᵀ u,  v ← (C ∘ C)ᵀ v
        u_new, v_new = torch.bmm(c.mT, u), torch.bmm(c2.mT, v)
    commit_(skip, u, u_new)
    commit_(skip, v, v_new)
    commit_(skip, q, q_new)
