"""LoRDO's grouped hot path: the parameters of one param group, shape and dtype as one stack,
each line of `thinwire.optim.lordo`'s equations one operation over the stack.

    Ĝ = G / max(1, ‖G‖_F / ρ)                  one stack of the gradients, one batched norm
    ĝ = P(Ĝ + E);  E ← Ĝ + E − P*(ĝ)           E += Ĝ, two `bmm`s, E −= lifted
    u, v, D                                      elementwise over the stacked moments
    θ ← θ (1 − η λ) − η [ω P*(u / D) + ...]      one `bmm`, `_foreach_mul_` / `_foreach_add_`
    Q_new = top-r of Δ̄;  u, v rotated           one batched SVD, three `bmm`s per stack

A stack holds the low-rank (or full-rank) members of one param group with one shape, dtype
(float32, bfloat16, float16) and device, contiguous and not sharded, with the same basis
size and error feedback. Its state is one buffer per name ([n, ...]: 'exp_avg',
'exp_avg_sq', and 'Q', 'error' for low-rank ones); each member's `state[p][name]` is a view
of it, so `state_dict` / `load_state_dict` see the per-parameter tensors they always did (a
tensor put there by a load, or the first step's zeros, is copied in at the next step). The
others (FSDP2 shards, float64, strided parameters) take the per-tensor path; so, for one
step, does a stack whose members do not all have a gradient or a common step count.

A GPU step's launches then grow with the number of stacks (distinct shapes), not tensors,
and read nothing on the host: ‖G‖_F, the clip's scale and mean(D) stay on the device.
Arithmetic: the equations' own; next to the per-tensor path, a batched norm, mean or GEMM
may sum in another order (float rounding only). bf16/fp16 parameters round each update term
to their dtype where the per-tensor path does (`add_to_params_`).
"""

from __future__ import annotations

import math

import torch

from ..ops import adam_denominator, adam_moments_, lowrank
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
        self.buffers = {name: torch.zeros((n, *states[0][name].shape), device=device)
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
        self.member = {i: s for s in self.stacks for i in s.members}


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


def step_stack_(s: Stack, params: list[torch.Tensor], t: int) -> None:
    """One local step of every member of `s` (all with a gradient, at step count t)."""
    group = s.group
    g = stacked_gradients([p.grad for p in params], s.dtype)
    clip_(g, group["clip"])
    if group["weight_decay"]:
        # θ ← θ (1 − η λ)   (low precision: the factor as a float32 0-dim tensor, as `p.mul_` takes it)
        decay = 1.0 - group["lr"] * group["weight_decay"]
        torch._foreach_mul_(params, decay if s.dtype == torch.float32 else s.factor(decay))
    if s.low_rank:
        low_rank_stack_(s, params, g.view(len(params), *s.matrix), t)
    else:
        full_rank_stack_(s, params, g, t)


def full_rank_stack_(s: Stack, params: list[torch.Tensor], g: torch.Tensor, t: int) -> None:
    """AdamW on Ĝ for every member (`lordo_tensor.full_rank_step_`), weight decay already applied."""
    (beta1, beta2), lr = s.group["betas"], s.group["lr"]
    u, v = s.buffers["exp_avg"], s.buffers["exp_avg_sq"]
    adam_moments_(u, v, g, beta1, beta2)
    d = adam_denominator(v, 1.0 - beta2 ** t, s.group["eps"])
    if s.dtype != torch.float32:                      # u and D rounded to θ's dtype, as per tensor
        u, d = u.to(s.dtype), d.to(s.dtype)
    # θ ← θ − η u / ((1 − β₁ᵗ) D)
    torch._foreach_addcdiv_(params, list(u.unbind(0)), list(d.unbind(0)), value=-lr / (1.0 - beta1 ** t))


def project(x: torch.Tensor, q: torch.Tensor, where: str) -> torch.Tensor:
    """`lowrank.project` of each matrix of the stack: X Q (right) or Qᵀ X (left)."""
    return torch.bmm(x, q) if where == lowrank.RIGHT else torch.bmm(q.mT, x)


def lift(g: torch.Tensor, q: torch.Tensor, where: str, out: torch.Tensor) -> torch.Tensor:
    """`lowrank.lift` of each matrix of the stack into `out`: g Qᵀ (right) or Q g (left)."""
    return torch.bmm(g, q.mT, out=out) if where == lowrank.RIGHT else torch.bmm(q, g, out=out)


def low_rank_stack_(s: Stack, params: list[torch.Tensor], g: torch.Tensor, t: int) -> None:
    """The low-rank step (`lordo_tensor.low_rank_step_`) of every member, g = Ĝ [n, p, rest];
    weight decay already applied."""
    (beta1, beta2), lr, omega = s.group["betas"], s.group["lr"], s.group["omega"]
    q, error, work = s.buffers["Q"], s.buffers.get("error"), torch.empty_like(g)
    # X = Ĝ + E, in E's buffer (E ← X − P*(ĝ) below)   (error_feedback=False: X = Ĝ)
    fed = g if error is None else error.add_(g)
    # ĝ = P(X)
    low = project(fed, q, s.where)
    if error is not None:
        # E ← X − P*(ĝ)
        error.sub_(lift(low, q, s.where, out=work))
    u, v = s.buffers["exp_avg"], s.buffers["exp_avg_sq"]
    # u ← β₁ u + (1 − β₁) ĝ,  v ← β₂ v + (1 − β₂) ĝ²     low-rank
    adam_moments_(u, v, low, beta1, beta2)
    # D = √(v / (1 − β₂ᵗ)) + ε                        low-rank, like u and v
    d = adam_denominator(v, 1.0 - beta2 ** t, s.group["eps"])
    if omega > 0.0:
        # θ ← θ − η ω P*(u / ((1 − β₁ᵗ) D))
        add_to_params_(params, lift(u / d, q, s.where, out=work), alpha=-lr * omega / (1.0 - beta1 ** t))
    if omega < 1.0:
        # θ ← θ − η (1 − ω) Ĝ / mean(D)
        coefficient = full_rank_coefficient(d.mean(dim=(1, 2)), lr, omega)
        add_to_params_(params, torch.mul(g, coefficient.view(-1, 1, 1), out=work))


def refresh_stack_(s: Stack, deltas: list[torch.Tensor]) -> None:
    """Q_new = top-r singular vectors of each member's Δ̄ (flat float32), u and v rotated from
    Q into Q_new (`lowrank.top_singular_basis`, `lowrank.rotate_moments`): one stack of the
    deltas, one batched SVD, three `bmm`s, written into the stack's buffers."""
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
    u.copy_(u_new)
    v.copy_(v_new)
    q.copy_(q_new)
