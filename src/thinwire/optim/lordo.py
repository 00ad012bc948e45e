"""LoRDO: low-rank Adam with infrequent synchronisation (Jovanović et al., arXiv 2602.04396).

Local step on rank m, for each matrix parameter θ (p x q; conv weights as p x rest):

    Ĝ = G · min(1, ρ / ‖G‖_F)                       clip per tensor (clip=None: off)
    ĝ = P(Ĝ + E)                                    P(X) = X Q (p ≥ q, Q q×r) or Qᵀ X (p < q, Q p×r)
    E ← Ĝ + E − P*(ĝ)                               error feedback; P*(g) = g Qᵀ or Q g
    u ← β₁ u + (1−β₁) ĝ,  v ← β₂ v + (1−β₂) ĝ²      low-rank moments, p×r or r×q
    D = √(v / (1−β₂ᵗ)) + ε                          low-rank denominator
    θ ← θ (1 − η λ) − η [ ω P*(u / ((1−β₁ᵗ) D)) + (1−ω) Ĝ / mean(D) ]

Sync every K = sync_every steps (after that step's local step), for all parameters in one
flat buffer (`thinwire.optim.periodic.PeriodicAveraging`: wire formats, error feedback, and
what a non-finite gradient does):

    Δ̄ = mean_ranks (θ − θ₀)                        one all-reduce (or compressed all-gather)
    θ₀ ← outer(θ₀, Δ̄);  θ ← θ₀                     default outer: plain averaging θ₀ + Δ̄
    Q_new = top-r singular vectors of Δ̄ (fp32 SVD); u, v rotated from Q into Q_new

Choices where the paper leaves room or differs from its code, stated:
  * Full-rank term normaliser: v is r-dimensional and cannot divide the p x q Ĝ
    elementwise; like the authors' code we divide by the scalar mean of the low-rank
    denominator, mean(√v̂ + ε), which is how the paper's μ(·) reads (μ = mean). The
    full-rank term uses the clipped gradient Ĝ, as the paper's equation, not Ĝ + E.
  * Adam bias correction (1−βᵗ) is applied, as in Adam and GaLore; the paper's equations
    omit it; t counts this parameter's local steps (state 'step'), as torch.optim.Adam's
    does. Weight decay is decoupled (AdamW). A parameter without a gradient takes no local
    step (no moments, no decay) but is synced like every other.
  * Initial Q (before the first sync): the first r columns of the identity, known to all
    ranks without communication. Moment rotation: see `thinwire.ops.lowrank.rotate_moments`.
  * Vectors, scalars and groups with low_rank=False (put embeddings and the head there)
    use full-rank AdamW on the clipped gradient, with the same local steps and sync.
  * rank > min(p, q) is clamped to min(p, q) with one warning per optimizer.

Two tiers (FSDP2 shards, `process_group` = the group across sites): E, θ₀ and the update run
on this rank's rows; the clip's ‖G‖_F, mean(D) and the SVD refresh use the whole matrix
(gathered or summed over the site); Q is whole on every rank; right side: ĝ and u, v are
row-sharded with no communication; left side: ĝ = Σ_shards Q_sᵀ X_s is summed over the site
and u, v hold this rank's share of its r rows (`low_rank_step_`).

Not dense Adam even at rank = min(p, q), ω = 1, no clipping, K = 1: each rank runs Adam on
its own gradient with its own moments and the parameters are then averaged, so the update
is mean_m(u_m / D_m), not ū / D̄; and after the first sync Q is the SVD basis of Δ, in
which Adam's per-coordinate second moment is a different preconditioner (Adam is not
rotation-invariant). Before the first refresh at one rank it is AdamW exactly.
Between syncs replicas differ by design; right after every sync they are bit-identical.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..ops import adam_denominator, adam_moments_, lowrank
from .base import Member
from .periodic import PeriodicAveraging, Slot
from .shards import is_sharded, own_rows, row_range, site_rank, site_size, site_sum_, whole


def _check_group(g: dict) -> None:
    """ValueError naming the first invalid hyperparameter of a param group."""
    if not g["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {g['lr']}")
    rank = g["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if not 0.0 <= g["omega"] <= 1.0:
        raise ValueError(f"omega must be in [0, 1], got {g['omega']}")
    if g["clip"] is not None and not g["clip"] > 0.0:
        raise ValueError(f"clip must be > 0 (or None for no clipping), got {g['clip']}")
    betas = tuple(g["betas"])
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {g['betas']}")
    if not g["eps"] >= 0.0:
        raise ValueError(f"eps must be >= 0, got {g['eps']}")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
    if g["low_rank"] not in (None, True, False):
        raise ValueError(f"low_rank must be None (auto: matrices), True or False, got {g['low_rank']!r}")


def clipped(grad: torch.Tensor, rho: float | None, norm: float) -> torch.Tensor:
    """Ĝ = G · min(1, ρ / ‖G‖_F), in float32 (ρ None: G, not clipped). Never written to.
    `norm` is ‖G‖_F of the whole gradient (`whole_norms`), of which `grad` may be a shard."""
    g = grad.float()
    if rho is None:
        return g
    return g * min(1.0, rho / max(norm, 1e-300))


def whole_norms(layout: list[Member]) -> list[float | None]:
    """‖G‖_F of each clipped parameter's whole gradient (None where it has no gradient or no
    clip). A shard's squares are summed over its site, every shard of a site in one
    all-reduce; the floats reach the host in one transfer."""
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
    norms = iter(values.tolist())
    return [next(norms) if c else None for c in clip]


def whole_mean(key: torch.Tensor, d: torch.Tensor, numel: int) -> float:
    """mean of the whole tensor (numel elements) whose site-split part d is."""
    if not is_sharded(key):
        return float(d.mean())
    return float(site_sum_(key, d.sum())) / numel


def full_rank_step_(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, t: int) -> None:
    """AdamW's step on Ĝ (vectors, scalars, low_rank=False); weight decay already applied."""
    (beta1, beta2), lr = group["betas"], group["lr"]
    u, v = state["exp_avg"], state["exp_avg_sq"]
    # u ← β₁ u + (1 − β₁) Ĝ,  v ← β₂ v + (1 − β₂) Ĝ²
    adam_moments_(u, v, g, beta1, beta2)
    # D = √(v / (1 − β₂ᵗ)) + ε
    d = adam_denominator(v, 1.0 - beta2 ** t, group["eps"])
    # θ ← θ − η u / ((1 − β₁ᵗ) D)
    p.addcdiv_(u.to(p.dtype), d.to(p.dtype), value=-lr / (1.0 - beta1 ** t))


def whole_shape(key: torch.Tensor) -> tuple[int, int]:
    """The parameter as a matrix: p × rest (conv weights o × i·kh·kw), whole, not its shard."""
    return key.shape[0], math.prod(key.shape[1:])


def low_rank_step_(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, t: int, key: torch.Tensor) -> None:
    """The low-rank step of the module docstring on Ĝ (as p × rest); weight decay already applied.

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
    if error is not None:
        # E ← X − P*(ĝ)
        torch.sub(fed, lowrank.lift(low, q_rows, where), out=error)
    mine = own_rows(key, low) if where == lowrank.LEFT else low    # our share of ĝ's r rows (left)
    u, v = state["exp_avg"], state["exp_avg_sq"]
    # u ← β₁ u + (1 − β₁) ĝ,  v ← β₂ v + (1 − β₂) ĝ²     low-rank
    adam_moments_(u, v, mine, beta1, beta2)
    # D = √(v / (1 − β₂ᵗ)) + ε                        low-rank, like u and v
    d = adam_denominator(v, 1.0 - beta2 ** t, group["eps"])
    if omega > 0.0:
        # θ ← θ − η ω P*(u / ((1 − β₁ᵗ) D))
        scaled = u / d if where == lowrank.RIGHT else whole(key, u / d, rows=low.shape[0])
        p.add_(lowrank.lift(scaled, q_rows, where).view(p.shape).to(p.dtype), alpha=-lr * omega / (1.0 - beta1 ** t))
    if omega < 1.0:
        # θ ← θ − η (1 − ω) Ĝ / mean(D)
        numel = low.shape[1] * (whole_shape(key)[0] if where == lowrank.RIGHT else low.shape[0])
        p.add_(g.to(p.dtype), alpha=-lr * (1.0 - omega) / whole_mean(key, d, numel))


def refresh_basis_(state: dict, mean_delta: torch.Tensor, key: torch.Tensor) -> None:
    """Q_new = top-r singular vectors of the whole Δ̄ (p × rest; our rows `mean_delta`,
    gathered over the site); u, v re-expressed from Q in Q_new (left side, sharded: the
    r rows are gathered, rotated, and our share kept)."""
    full = whole(key, mean_delta)
    where, q_old = lowrank.side(tuple(full.shape)), state["Q"]
    q_new = lowrank.top_singular_basis(full, q_old.shape[1], where)
    u, v = state["exp_avg"], state["exp_avg_sq"]
    if where == lowrank.LEFT and is_sharded(key):
        u, v = whole(key, u, rows=q_old.shape[1]), whole(key, v, rows=q_old.shape[1])
    u, v = lowrank.rotate_moments(u, v, q_old, q_new, where)
    if where == lowrank.LEFT:
        u, v = own_rows(key, u).clone(), own_rows(key, v).clone()
    state["exp_avg"], state["exp_avg_sq"], state["Q"] = u, v, q_new


class LoRDO(PeriodicAveraging):
    """Low-rank Adam between syncs, parameter averaging every `sync_every` steps; see the
    module docstring for the equations and the choices made.

    Args:
        lr: η. rank: r, the projection rank (clamped to min(p, q) with a warning).
        sync_every: K, local steps between syncs. omega: ω in [0, 1], weight of the
            low-rank momentum (1 − ω goes to the full-rank term). clip: ρ, per-tensor L2
            clip of the gradient (None: off). betas, eps: Adam's. weight_decay: decoupled λ.
        low_rank (per group): None (default: parameters with ≥ 2 dims are low-rank),
            True or False (False: full-rank AdamW; use it for embeddings and the head).
        error_feedback (per group): keep E (default True; False saves one p x q buffer).
        wire: 'fp32' (default, all-reduce) | 'bf16' | 'int8' for the synced delta, with
            error feedback (see `thinwire.optim.periodic`).
        outer_lr, outer_momentum: optional Nesterov outer step on the averaged delta;
            the defaults 1.0 and 0.0 are plain averaging.
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite
            (see `thinwire.optim.periodic`).
        overlap: True leaves each sync's exchange in flight until the next step(), which
            applies it before its local step (`thinwire.optim.periodic`, "Overlap").
    Initial parameters must be identical on all ranks (as with DDP's broadcast).
    State per parameter: 'step', 'exp_avg', 'exp_avg_sq' (float32), for low-rank ones 'Q'
    and 'error' (float32, p × rest), and the sync's 'anchor' etc. (`PeriodicAveraging`).
    """

    kind = "lordo"

    def __init__(self, params, lr: float = 1e-3, rank: int = 256, sync_every: int = 32, omega: float = 0.97,
                 clip: float | None = 1.0, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 process_group=None, *, low_rank: bool | None = None, error_feedback: bool = True,
                 wire: str = "fp32", outer_lr: float = 1.0, outer_momentum: float = 0.0, nonfinite: str = "raise",
                 overlap: bool = False):
        defaults = dict(lr=lr, rank=rank, omega=omega, clip=clip, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, low_rank=low_rank, error_feedback=error_feedback)
        _check_group(defaults)
        super().__init__(params, defaults)
        self._init_sync(process_group, nonfinite, sync_every, outer_lr, outer_momentum, wire, overlap)
        self._warned = False

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @staticmethod
    def is_low_rank(group: dict, p: torch.Tensor) -> bool:
        return p.dim() >= 2 if group["low_rank"] is None else bool(group["low_rank"]) and p.dim() >= 2

    def _rank_of(self, group: dict, shape: tuple[int, int]) -> int:
        r = min(group["rank"], *shape)
        if r < group["rank"] and not self._warned:
            self._warned = True
            warnings.warn(f"LoRDO rank {group['rank']} exceeds min(p, q) of a {shape[0]}x{shape[1]} parameter; "
                          f"clamped to {r} (warned once)", stacklevel=7)
        return r

    def _describe_param(self, group: dict, p: torch.Tensor) -> str:
        return f"rank={group['rank']},low_rank={group['low_rank']}"

    def _prepare(self, step: int, layout: list[Member]) -> None:
        super()._prepare(step, layout)
        for group, p, key in layout:
            state = self.state[key]
            if "exp_avg" in state:
                continue
            state["step"] = 0
            if self.is_low_rank(group, p):
                shape = whole_shape(key)                              # p × rest (conv weights: o × i·kh·kw)
                r = self._rank_of(group, shape)
                small = lowrank.low_rank_shape(shape, r)              # whole; our rows of it under FSDP2:
                rows = row_range(small[0], site_size(key), site_rank(key))
                small = (rows[1] - rows[0], small[1])
                state.update(Q=lowrank.initial_basis(shape, r, device=p.device),
                             exp_avg=torch.zeros(small, device=p.device),
                             exp_avg_sq=torch.zeros(small, device=p.device))
                if group["error_feedback"]:
                    state["error"] = torch.zeros(p.shape[0], shape[1], device=p.device)
            else:
                state.update(exp_avg=torch.zeros_like(p, dtype=torch.float32),
                             exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))

    def _local_step(self, step: int, layout: list[Member]) -> None:
        for (group, p, key), norm in zip(layout, whole_norms(layout)):
            if p.grad is None:                                        # no gradient: no local step
                continue
            state = self.state[key]
            state["step"] += 1
            g = clipped(p.grad, group["clip"], norm)
            if group["weight_decay"]:
                # θ ← θ (1 − η λ)
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
            if "Q" in state:
                low_rank_step_(p, g, state, group, state["step"], key)
            else:
                full_rank_step_(p, g, state, group, state["step"])

    def _after_sync(self, slot: Slot, mean_delta: torch.Tensor) -> None:
        state = self.state[slot.key]
        if "Q" in state:
            refresh_basis_(state, mean_delta.view(slot.param.shape[0], -1), slot.key)
