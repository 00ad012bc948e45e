"""LoRDO: low-rank Adam with infrequent synchronisation (Jovanović et al., arXiv 2602.04396).

Local step on rank m, for each matrix parameter θ (p x q; conv weights as p x rest):

    Ĝ = G · min(1, ρ / ‖G‖_F)                       clip per tensor (clip=None: off)
    ĝ = P(Ĝ + E)                                    P(X) = X Q (p ≥ q, Q q×r) or Qᵀ X (p < q, Q p×r)
    E ← Ĝ + E − P*(ĝ)                               error feedback; P*(g) = g Qᵀ or Q g
    u ← β₁ u + (1−β₁) ĝ,  v ← β₂ v + (1−β₂) ĝ²      low-rank moments, p×r or r×q
    D = √(v / (1−β₂ᵗ)) + ε                          low-rank denominator
    θ ← θ (1 − η λ) − η [ ω P*(u / ((1−β₁ᵗ) D)) + (1−ω) Ĝ / mean(D) ]

Sync every K = sync_every steps, for all parameters in one flat buffer:

    Δ = mean_ranks (θ − θ₀)                         one all-reduce (or compressed all-gather)
    θ₀ ← outer(θ₀, Δ);  θ ← θ₀                      default outer: plain averaging θ₀ + Δ
    Q_new = top-r singular vectors of Δ (fp32 SVD);  u, v rotated from Q into Q_new

Choices where the paper leaves room or differs from its code, stated:
  * Full-rank term normaliser: v is r-dimensional and cannot divide the p x q Ĝ
    elementwise; like the authors' code we divide by the scalar mean of the low-rank
    denominator, mean(√v̂ + ε), which is how the paper's μ(·) reads (μ = mean). The
    full-rank term uses the clipped gradient Ĝ, as the paper's equation, not Ĝ + E.
  * Adam bias correction (1−βᵗ) is applied, as in Adam and GaLore; the paper's equations
    omit it. Weight decay is decoupled (AdamW).
  * Initial Q (before the first sync): the first r columns of the identity, known to all
    ranks without communication. Moment rotation: see `thinwire.ops.lowrank.rotate_moments`.
  * Vectors, scalars and groups with low_rank=False (put embeddings and the head there)
    use full-rank AdamW on the clipped gradient, with the same local steps and sync.
  * rank > min(p, q) is clamped to min(p, q) with one warning per optimizer.

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

from ..ops import lowrank
from .base import CommunicatingOptimizer
from .diloco import DeltaSync, check_outer, check_sync_every, outer_step

_GROUP_KEYS = ("lr", "rank", "omega", "clip", "betas", "eps", "weight_decay", "low_rank", "error_feedback")


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


class LoRDO(CommunicatingOptimizer):
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
            error feedback (see `thinwire.optim.diloco.DeltaSync`).
        outer_lr, outer_momentum: optional Nesterov outer step on the averaged delta;
            the defaults 1.0 and 0.0 are plain averaging.
    Initial parameters must be identical on all ranks (as with DDP's broadcast).
    """

    def __init__(self, params, lr: float = 1e-3, rank: int = 256, sync_every: int = 32, omega: float = 0.97,
                 clip: float | None = 1.0, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 process_group=None, *, low_rank: bool | None = None, error_feedback: bool = True,
                 wire: str = "fp32", outer_lr: float = 1.0, outer_momentum: float = 0.0):
        defaults = dict(lr=lr, rank=rank, omega=omega, clip=clip, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, low_rank=low_rank, error_feedback=error_feedback)
        _check_group(defaults)
        self.sync_every = check_sync_every(sync_every)
        check_outer(outer_lr, outer_momentum)
        self.outer_lr, self.outer_momentum, self.wire = outer_lr, outer_momentum, wire
        super().__init__(params, defaults)
        self._init_comm(process_group)
        self.sync = DeltaSync(self.comm, wire)
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
                          f"clamped to {r} (warned once)", stacklevel=3)
        return r

    def _describe(self) -> str:
        lines = [f"lordo world_size={self.comm.world_size} K={self.sync_every} wire={self.wire} "
                 f"outer={self.outer_lr},{self.outer_momentum}"]
        for g in self.param_groups:
            wire = ",".join(f"{k}={g[k]}" for k in ("rank", "low_rank"))
            lines += [f"{tuple(p.shape)} {p.dtype} {wire}" for p in g["params"]]
        return "\n".join(lines)

    def _init_state(self, group: dict, p: torch.Tensor) -> dict:
        state = self.state[p]
        state.update(step=0, anchor=p.detach().clone())
        if self.is_low_rank(group, p):
            shape = (p.shape[0], p[0].numel())
            r = self._rank_of(group, shape)
            small = lowrank.low_rank_shape(shape, r)
            state.update(Q=lowrank.initial_basis(shape, r, device=p.device),
                         exp_avg=torch.zeros(small, device=p.device), exp_avg_sq=torch.zeros(small, device=p.device))
            if group["error_feedback"]:
                state["error"] = torch.zeros(shape, device=p.device)
        else:
            state.update(exp_avg=torch.zeros_like(p, dtype=torch.float32),
                         exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._begin_step(closure)
        description = self._describe()
        self._agree(description)
        params = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p] or self._init_state(group, p)
                state["step"] += 1
                params.append(p)
                if p.grad is not None:
                    self._local_step(group, p, state)
        step = self.state[params[0]]["step"]
        if step % self.sync_every == 0:
            self._sync(params, step)
        return loss

    def _local_step(self, group: dict, p: torch.Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        t, lr = state["step"], group["lr"]
        grad = p.grad.detach().float()
        if group["clip"] is not None:
            grad = grad * min(1.0, group["clip"] / max(float(grad.norm()), 1e-300))
        bc1, bc2_sqrt = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
        u, v = state["exp_avg"], state["exp_avg_sq"]
        if group["weight_decay"]:
            p.mul_(1.0 - lr * group["weight_decay"])
        if "Q" not in state:                               # full-rank AdamW
            u.lerp_(grad, 1.0 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            denom = (v.sqrt() / bc2_sqrt).add_(group["eps"])
            p.addcdiv_(u.to(p.dtype), denom.to(p.dtype), value=-lr / bc1)
            return
        matrix, q = grad.view(p.shape[0], -1), state["Q"]
        where = lowrank.side(tuple(matrix.shape))
        fed = matrix + state["error"] if "error" in state else matrix
        g = lowrank.project(fed, q, where)
        if "error" in state:
            state["error"].copy_(fed - lowrank.lift(g, q, where))
        u.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(group["eps"])
        omega, view = group["omega"], p.view(p.shape[0], -1)
        if omega > 0.0:
            view.add_(lowrank.lift(u / denom, q, where).to(p.dtype), alpha=-lr * omega / bc1)
        if omega < 1.0:
            view.add_(matrix.to(p.dtype), alpha=-lr * (1.0 - omega) / float(denom.mean()))

    def _sync(self, params: list, step: int) -> None:
        """Average the deltas since the last sync, move every replica to the result, and
        refresh each low-rank parameter's basis from the averaged delta."""
        mean = self.sync.mean_delta(params, self.state, step)
        offset = 0
        for p in params:
            state, n = self.state[p], p.numel()
            part = mean[offset: offset + n]
            if self.outer_momentum and "outer_momentum" not in state:
                state["outer_momentum"] = torch.zeros(n, device=p.device)
            outer_step(state["anchor"].view(-1), part, state.get("outer_momentum"), self.outer_lr,
                       self.outer_momentum)
            p.copy_(state["anchor"])
            if "Q" in state:
                self._refresh(state, part.view(p.shape[0], -1))
            offset += n

    @staticmethod
    def _refresh(state: dict, mean_delta: torch.Tensor) -> None:
        where, q_old = lowrank.side(tuple(mean_delta.shape)), state["Q"]
        q_new = lowrank.top_singular_basis(mean_delta, q_old.shape[1], where)
        state["exp_avg"], state["exp_avg_sq"] = lowrank.rotate_moments(
            state["exp_avg"], state["exp_avg_sq"], q_old, q_new, where)
        state["Q"] = q_new
