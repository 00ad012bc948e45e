"""LoRDO's per-tensor path (`thinwire.optim.lordo`'s equations, one parameter at a time): the
parameters no stack takes (`thinwire.optim.lordo_groups`: FSDP2 shards, float64, strided
ones), and for one step a stack whose members lack a gradient or a common step count.

Nothing here waits for the device: ‖G‖_F, the clip's scale and mean(D) stay 0-dim tensors on
the device (they were read on the host before, one read per matrix and step; now a few more
launches per matrix instead), and a skipped step is masked as on the stacked path
(`step_each_`, `refresh_basis_`). In tests/optim/test_lordo_audit.py's audit this path's
local step makes 587 / 2,051 launches at 2 / 8 blocks and no read (450 / 1,578 and one read,
the envelope's check of the gradients, unmasked; 364 / 1,276 and 12 / 36 reads before that).

Under FSDP2 (two tiers) E, θ₀ and the update run on this rank's rows; the clip's ‖G‖_F,
mean(D) and the SVD refresh use the whole matrix (gathered or summed over the site).
"""

from __future__ import annotations

import math

import torch

from ..ops import adam_denominator, adam_moments_, lowrank
from .base import Member
from .lordo_groups import full_rank_coefficient, zero_where_
from .shards import is_sharded, own_rows, site_sum_, whole

KEPT = ("exp_avg", "exp_avg_sq", "Q")                   # what a basis refresh writes


def moments_(u: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float,
             skip: torch.Tensor | None) -> None:
    """`ops.adam_moments_`; where `skip` is set (g is 0 there) u's lerp goes to u itself and v's
    factor is 1, so both keep their values (as `lordo_groups.moments_all_`)."""
    if skip is None:
        adam_moments_(u, v, g, beta1, beta2)
        return
    u.lerp_(torch.where(skip, u, g), 1 - beta1)
    v.mul_(torch.where(skip, 1.0, beta2)).addcmul_(g, g, value=1 - beta2)


def clipped(grad: torch.Tensor, rho: float | None, norm: torch.Tensor | None) -> torch.Tensor:
    """Ĝ = G / max(1, ‖G‖_F / ρ) = G · min(1, ρ / ‖G‖_F), in float32, on the device (ρ None: G,
    not clipped). Never written to. `norm` (0-dim) is ‖G‖_F of the whole gradient
    (`whole_norms`), of which `grad` may be a shard."""
    g = grad.float()
    if rho is None:
        return g
    return g / norm.div(rho).clamp_(min=1.0)


def whole_norms(layout: list[Member]) -> list[torch.Tensor | None]:
    """‖G‖_F of each clipped parameter's whole gradient as 0-dim tensors on the device (None
    where it has no gradient or no clip). A shard's squares are summed over its site, every
    shard of a site in one all-reduce; nothing is read on the host."""
    clip = [m.param.grad is not None and m.group["clip"] is not None for m in layout]
    values = [(m.param.grad.float().square().sum() if is_sharded(m.key) else m.param.grad.float().norm())
              for m, c in zip(layout, clip) if c]
    if not values:
        return [None] * len(layout)
    values = torch.stack(values)                       # [clipped parameters]
    kept = [m for m, c in zip(layout, clip) if c]
    by_site: dict = {}                                 # site group -> rows of its shards
    for i, m in enumerate(kept):
        if is_sharded(m.key):
            by_site.setdefault(m.key.device_mesh.get_group(), []).append(i)
    for rows in by_site.values():                      # the same rows on every rank of the site
        index = torch.tensor(rows, device=values.device)
        values[index] = site_sum_(kept[rows[0]].key, values[index]).sqrt()
    norms = iter(values.unbind(0))
    return [next(norms) if c else None for c in clip]


def whole_mean(key: torch.Tensor, d: torch.Tensor, numel: int) -> torch.Tensor:
    """mean of the whole tensor (numel elements) whose site-split part d is, 0-dim on the device."""
    if not is_sharded(key):
        return d.mean()
    return site_sum_(key, d.sum()) / numel


def full_rank_step_(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, t: int,
                    skip: torch.Tensor | None = None) -> None:
    """AdamW's step on Ĝ (vectors, scalars, low_rank=False); weight decay already applied.
    Where `skip` is set (Ĝ is −0 then), u and v are kept and u / D taken as 0."""
    (beta1, beta2), lr = group["betas"], group["lr"]
    u, v = state["exp_avg"], state["exp_avg_sq"]
    # u ← β₁ u + (1 − β₁) Ĝ,  v ← β₂ v + (1 − β₂) Ĝ²
    moments_(u, v, g, beta1, beta2, skip)
    # D = √(v / (1 − β₂ᵗ)) + ε
    d = adam_denominator(v, 1.0 - beta2 ** t, group["eps"])
    # θ ← θ − η u / ((1 − β₁ᵗ) D)
    u = u if skip is None else u.masked_fill(skip, 0.0)
    p.addcdiv_(u.to(p.dtype), d.to(p.dtype), value=-lr / (1.0 - beta1 ** t))


def whole_shape(key: torch.Tensor) -> tuple[int, int]:
    """The parameter as a matrix: p × rest (conv weights o × i·kh·kw), whole, not its shard."""
    return key.shape[0], math.prod(key.shape[1:])


def low_rank_step_(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, t: int, key: torch.Tensor,
                   skip: torch.Tensor | None = None) -> None:
    """The low-rank step of the module docstring on Ĝ (as p × rest); weight decay already applied.
    Where `skip` is set (Ĝ is −0 then), ĝ, u / D and the coefficient are zeros: θ, E, u, v kept.

    Under FSDP2 p and g are this rank's rows of the parameter `key`; E is row-sharded like
    them and Q is whole on every rank. Right side: ĝ = X Q has our rows only, so u, v are
    row-sharded and nothing is communicated. Left side: ĝ = Qᵀ X = Σ_shards Q_sᵀ X_s is
    summed over the site (r × q), and u, v hold our share of its r rows; u / D is gathered
    back (r × q) to lift our rows of Q (u / D). mean(D) is the whole D's."""
    (beta1, beta2), lr, omega = group["betas"], group["lr"], group["omega"]
    matrix, q, error = g.reshape(p.shape[0], -1), state["Q"], state.get("error")
    where = lowrank.side(whole_shape(key))
    q_rows = own_rows(key, q) if where == lowrank.LEFT else q      # Q_s: our rows of a p × r basis
    # X = Ĝ + E                                       (error_feedback=False: X = Ĝ)
    fed = matrix if error is None else matrix + error
    # ĝ = P(X)                                        (left, sharded: Σ over the site of Q_sᵀ X_s)
    low = lowrank.project(fed, q_rows, where)
    if where == lowrank.LEFT:
        site_sum_(key, low)
    zero_where_(skip, low)
    if error is not None:
        # E ← X − P*(ĝ)
        torch.sub(fed, lowrank.lift(low, q_rows, where), out=error)
    mine = own_rows(key, low) if where == lowrank.LEFT else low    # our share of ĝ's r rows (left)
    u, v = state["exp_avg"], state["exp_avg_sq"]
    # u ← β₁ u + (1 − β₁) ĝ,  v ← β₂ v + (1 − β₂) ĝ²     low-rank
    moments_(u, v, mine, beta1, beta2, skip)
    # D = √(v / (1 − β₂ᵗ)) + ε                        low-rank, like u and v
    d = adam_denominator(v, 1.0 - beta2 ** t, group["eps"])
    if omega > 0.0:
        # θ ← θ − η ω P*(u / ((1 − β₁ᵗ) D))
        scaled = zero_where_(skip, u / d)
        scaled = scaled if where == lowrank.RIGHT else whole(key, scaled, rows=low.shape[0])
        p.add_(lowrank.lift(scaled, q_rows, where).view(p.shape).to(p.dtype), alpha=-lr * omega / (1.0 - beta1 ** t))
    if omega < 1.0:
        # θ ← θ − η (1 − ω) Ĝ / mean(D)
        numel = low.shape[1] * (whole_shape(key)[0] if where == lowrank.RIGHT else low.shape[0])
        p.add_(g.mul(zero_where_(skip, full_rank_coefficient(whole_mean(key, d, numel), lr, omega))).to(p.dtype))


def refresh_basis_(state: dict, mean_delta: torch.Tensor, key: torch.Tensor, skip: torch.Tensor | None = None) -> None:
    """Q_new = top-r singular vectors of the whole Δ̄ (p × rest; our rows `mean_delta`,
    gathered over the site); u, v re-expressed from Q in Q_new (left side, sharded: the
    r rows are gathered, rotated, and our share kept); Q, u, v kept where `skip` is set."""
    full = whole(key, mean_delta)
    where, q_old = lowrank.side(tuple(full.shape)), state["Q"]
    q_new = lowrank.top_singular_basis(full, q_old.shape[1], where)
    u, v = state["exp_avg"], state["exp_avg_sq"]
    if where == lowrank.LEFT and is_sharded(key):
        u, v = whole(key, u, rows=q_old.shape[1]), whole(key, v, rows=q_old.shape[1])
    u, v = lowrank.rotate_moments(u, v, q_old, q_new, where)
    if where == lowrank.LEFT:
        u, v = own_rows(key, u).clone(), own_rows(key, v).clone()
    if skip is not None:
        u, v, q_new = (torch.where(skip, state[k], new) for k, new in zip(KEPT, (u, v, q_new)))
    state["exp_avg"], state["exp_avg_sq"], state["Q"] = u, v, q_new


def site_flag(members: list[Member], skip: torch.Tensor | None) -> torch.Tensor | None:
    """`skip` ORed over each FSDP2 site: its ranks hold one replica whose clip norms, ĝ and
    u / D are summed or gathered over the site, so one shard's non-finite gradient skips the
    replica's step on all of them (an all-reduce per site, on the device; plain layouts: `skip`)."""
    sites = {m.key.device_mesh.get_group(): m.key for m in members if is_sharded(m.key)}
    if skip is None or not sites:
        return skip
    flag = skip.to(torch.float32).view(1)
    for key in sites.values():
        site_sum_(key, flag)
    return flag.view(()).gt(0)


def step_each_(state_of, members: list[Member], skip: torch.Tensor | None = None) -> list[dict]:
    """The local step of each of `members` that has a gradient (`state_of(key)` its state);
    the states it counted. Under `skip` nothing keeps a value it changed where it is set (Ĝ
    taken as −0, the decay as 1, `low_rank_step_` / `full_rank_step_`), unread."""
    counted, factors = [], {}
    for (group, p, key), norm in zip(members, whole_norms(members)):
        if p.grad is None:                                            # no gradient: no local step
            continue
        state = state_of(key)
        state["step"] += 1
        counted.append(state)
        g = clipped(p.grad, group["clip"], norm)
        g = g if skip is None else g.masked_fill(skip, -0.0)         # not in place: g may be p.grad
        if group["weight_decay"]:
            # θ ← θ (1 − η λ)
            p.mul_(decay_factor(1.0 - group["lr"] * group["weight_decay"], p, skip, factors))
        if "Q" in state:
            low_rank_step_(p, g, state, group, state["step"], key, skip)
        else:
            full_rank_step_(p, g, state, group, state["step"], skip)
    return counted


def decay_factor(decay: float, p: torch.Tensor, skip: torch.Tensor | None, made: dict) -> float | torch.Tensor:
    """The decay, or under `skip` a 0-dim tensor holding it (1 where set), made once per value
    in `made`: float64 for float64 θ, else float32, which `mul_` uses as it uses the Python float."""
    if skip is None:
        return decay
    dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    key = (decay, dtype, p.device)
    if key not in made:
        made[key] = torch.full((), decay, dtype=dtype, device=p.device).masked_fill_(skip, 1.0)
    return made[key]
