"""LoRDO: low-rank Adam with infrequent synchronisation (Jovanović et al., arXiv 2602.04396).

Local step on rank m, for each matrix parameter θ (p x q; conv weights as p x rest):

    Ĝ = G · min(1, ρ / ‖G‖_F)                       clip per tensor (clip=None: off)
    ĝ = P(Ĝ + E)                                    P(X) = X Q (p ≥ q, Q q×r) or Qᵀ X (p < q, Q p×r)
    E ← Ĝ + E − P*(ĝ)                               error feedback; P*(g) = g Qᵀ or Q g
    u ← β₁ u + (1−β₁) ĝ,  v ← β₂ v + (1−β₂) ĝ²      low-rank moments, p×r or r×q
    D = √(v / (1−β₂ᵗ)) + ε                          low-rank denominator
    θ ← θ (1 − η λ) − η [ ω P*(u / ((1−β₁ᵗ) D)) + (1−ω) Ĝ / mean(D) ]

Sync every K = sync_every steps (after that step's local step), for all parameters in one
flat buffer (`thinwire.optim.periodic.PeriodicAveraging` with the sync rule
`thinwire.optim.dense_mean.DenseMean`: wire formats, error feedback; what a non-finite gradient does):

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
and u, v hold this rank's share of its r rows (`thinwire.optim.lordo_tensor.low_rank_step_`).

What a step costs a GPU (issue 47; docs/design.md, "What a step costs a GPU"): the parameters
of one param group, shape and dtype form a stack (`thinwire.optim.lordo_groups`) and each line
above runs once per stack (one stack of the gradients, batched norms, `bmm`, `_foreach_*` on
the parameters) or, where it is elementwise (decay, u, v, D), once over every stack, so a
local step launches as many kernels at 100 tensors as at 28. Nothing is read on the host:
the clip's scale and mean(D) stay on the device, and a local step runs under this rank's
non-finite flag (`_masks_nonfinite`), where set taking Ĝ and ĝ as zeros, the decay as 1, u's
lerp to u and v's factor as 1, the update terms as zeros, so nothing moves; t (1 − βᵗ is a
host float) is counted at once and taken back when the flag's copy, made without waiting, is
read at the next call (`_defer_counts`): every t is the unmasked step's. With
nonfinite='raise' the sync reads the host once (the envelope's check of the delivery, every
rank's flags in it); with 'skip' the fp32 sync lands under the device's verdict
(`thinwire.optim.verdict`), the bases' refresh with it. A sync refreshes each stack's bases
with one batched SVD (on a GPU its own synchronisation, which the audit does not see, once
per stack instead of once per matrix). `thinwire.audit.StepAudit` at world 2 (GPT-2 shapes of
width 16 at 2 / 8 blocks, rank 4, K 4, tests/optim/test_lordo_audit.py): a local step made
364 / 1,276 launches and 12 / 36 host reads one matrix at a time, 96 and 1 stacked, now 130
and 0 at both (131 from the second local step with 'raise': the carried flag's OR); the sync
step 441 / 1,521 and 13 / 37, then 141 and 2, now 176 and 1 ('raise') or 187 and 0 ('skip').
The masks cost those 34 launches, no read, and change no number where the flag is not set
(bit for bit on CPU, stacked and per-tensor). Same equations; the batched norms, means, GEMMs
and SVDs may sum in another order than one matrix at a time (float rounding), the clip
divides by max(1, ‖G‖_F / ρ) rather than multiply by min(1, ρ / ‖G‖_F), and the full-rank term
adds Ĝ · (−η (1−ω) / mean(D)) (the same numbers up to rounding). tests/optim/test_lordo.py
and test_lordo_groups.py (stacks of several parameters) hold LoRDO to independent per-matrix
simulations of the equations; on CPU the stacked and per-tensor paths agreed bit for bit there.

Not dense Adam even at rank = min(p, q), ω = 1, no clipping, K = 1: each rank runs Adam on
its own gradient with its own moments and the parameters are then averaged, so the update
is mean_m(u_m / D_m), not ū / D̄; and after the first sync Q is the SVD basis of Δ, in
which Adam's per-coordinate second moment is a different preconditioner (Adam is not
rotation-invariant). Before the first refresh at one rank it is AdamW exactly.
Between syncs replicas differ by design; right after every sync they are bit-identical.
"""

from __future__ import annotations

import warnings

import torch

from ..ops import lowrank
from .base import Member
from .elastic_rules import PER_RANK, PERIODIC, REPLICATED
from .lordo_groups import Stacks, refresh_stack_, signature, step_stacks_
from .lordo_tensor import refresh_basis_, site_flag, step_each_, whole_shape
from .dense_mean import DenseMean
from .periodic import PeriodicAveraging, Slot, check_sync_every, of_sync
from .shards import row_range, site_rank, site_size
from .verdict import PendingVerdicts


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
            error feedback (see `thinwire.optim.dense_mean`).
        outer_lr, outer_momentum: optional Nesterov outer step on the averaged delta;
            the defaults 1.0 and 0.0 are plain averaging.
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite
            (see `thinwire.optim.periodic`); a rank's own skipped local step is masked on the
            device, and with 'skip' an fp32 sync too: no host read (module docstring).
        overlap: True leaves each sync's exchange in flight until the next step(), which
            applies it before its local step (`thinwire.optim.periodic`, "Overlap").
    Initial parameters must be identical on all ranks (as with DDP's broadcast).
    State per parameter: 'step', 'exp_avg', 'exp_avg_sq' (float32), for low-rank ones 'Q'
    and 'error' (float32, p × rest), and the sync's 'anchor' etc. (`PeriodicAveraging`,
    `DenseMean`); a stacked parameter's tensors are views of its stack's buffers (`lordo_groups`).
    """

    kind = "lordo"
    outer_lr, outer_momentum, wire, codec = (of_sync(name) for name in ("outer_lr", "outer_momentum", "wire", "codec"))

    def __init__(self, params, lr: float = 1e-3, rank: int = 256, sync_every: int = 32, omega: float = 0.97,
                 clip: float | None = 1.0, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 process_group=None, *, low_rank: bool | None = None, error_feedback: bool = True,
                 wire: str = "fp32", outer_lr: float = 1.0, outer_momentum: float = 0.0, nonfinite: str = "raise",
                 overlap: bool = False):
        defaults = dict(lr=lr, rank=rank, omega=omega, clip=clip, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, low_rank=low_rank, error_feedback=error_feedback)
        _check_group(defaults)
        super().__init__(params, defaults)
        check_sync_every(sync_every)
        self._init_sync(process_group, nonfinite, sync_every, DenseMean(outer_lr, outer_momentum, wire), overlap)
        self._warned = False
        self.grouped = True                       # False: every parameter on the per-tensor path
        self._stacks: tuple | None = None         # (layout key, `Stacks`), kept while the layout stays
        self._synced: dict | None = None          # inside `_apply`: id(parameter) -> its Δ̄
        # masked local steps' flags, read a call later to take their counts back; host buffers
        # shared with the envelope's verdicts, where `thinwire.audit` finds them
        self._counts = PendingVerdicts()
        self._counts.buffers = self._verdicts.buffers

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    # the sync's state as DiLoCo's; Q the same on every rank; the local moments and E each rank's own
    ELASTIC_KINDS = {**PERIODIC, "Q": REPLICATED, "*": PER_RANK}

    def _elastic_numel(self, group: dict, p: torch.Tensor, key: str, per_param: dict) -> int | None:
        if "Q" in per_param and key in ("Q", "exp_avg", "exp_avg_sq"):
            return None                                          # low-rank: the rank's shape
        return super()._elastic_numel(group, p, key, per_param)

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

    def _grouping(self, layout: list[Member]) -> Stacks:
        """The layout's stacks (`thinwire.optim.lordo_groups`), rebuilt when a member's signature
        changes; each stacked member's state a view of its stack's buffers."""
        states = [self.state[m.key] for m in layout]
        signatures = [signature(m, st) if self.grouped else None for m, st in zip(layout, states)]
        key = (tuple(id(m.key) for m in layout), tuple(signatures))
        if self._stacks is None or self._stacks[0] != key:
            self._stacks = (key, Stacks(layout, states, signatures))
        stacks = self._stacks[1]
        for stack in stacks.stacks:
            stack.adopt([states[i] for i in stack.members])
        return stacks

    def _masks_nonfinite(self, layout: list[Member]) -> bool:
        """A local step runs under this rank's flag (`gradients_nonfinite`): where it is set
        nothing keeps a value it changed (`step_stacks_`, `step_each_`), read by no one."""
        return True

    def _applies_masked(self, layout: list[Member]) -> bool:
        """The fp32 sync (delay 1) lands under the device's verdict, the bases' refresh too."""
        return self.codec is None and self.delay == 1

    def _local_step(self, step: int, layout: list[Member]) -> None:
        """Every stack in one step when all its members have a gradient and one step count;
        the other parameters (and such a stack's, this step) one at a time."""
        self._counts.judge()                  # the counts of an earlier skipped local step taken back
        stacks, rest, work, counted = self._grouping(layout), [], [], []
        skip = site_flag(layout, self.gradients_nonfinite)
        for stack in stacks.stacks:
            params = [layout[i].param for i in stack.members]
            states = [self.state[layout[i].key] for i in stack.members]
            counts = {state["step"] for state in states}
            if len(counts) > 1 or any(p.grad is None for p in params):
                rest += stack.members
                continue
            for state in states:
                state["step"] += 1
            counted += states
            work.append((stack, params, counts.pop() + 1))
        step_stacks_(work, skip)
        counted += step_each_(self.state.__getitem__, [layout[i] for i in sorted(stacks.rest + rest)], skip)
        if skip is not None and counted:
            self._defer_counts(step, counted, skip)

    def _defer_counts(self, step: int, counted: list[dict], skip: torch.Tensor) -> None:
        """The host counted this masked step for `counted` (t of Adam's 1 − βᵗ, a host float);
        where `skip` was set the step moved nothing, and its count is taken back when the flag,
        copied to the host unwaited, is read: at the next step() or local step, before any t
        is used again, so every t is the one an unmasked step would have used."""
        def judge(values: list) -> tuple[list, list]:
            if values[0]:
                for state in counted:
                    state["step"] -= 1
            return [], []                     # a rank's own local skip: not a skipped step of all ranks
        self._counts.push(step, skip.view(1), judge)

    def state_dict(self):
        self._counts.judge()                  # counts of skipped local steps taken back first
        return super().state_dict()

    def _drain(self) -> None:
        self._counts.clear()                  # a load replaces the states they would correct
        super()._drain()

    def _apply(self, step: int, layout: list[Member], delivery, skip: torch.Tensor | None = None) -> None:
        """The sync (`PeriodicAveraging._apply`), then the bases refreshed from the Δ̄ that
        `_after_sync` set aside: each stack's in one batch, the others one at a time (where
        `skip` is set, from `_apply_masked`: none)."""
        self._synced = {}
        try:
            super()._apply(step, layout, delivery, skip)
            stacks = self._grouping(layout)
            for stack in stacks.stacks:
                if stack.low_rank:
                    refresh_stack_(stack, [self._synced[id(layout[i].key)] for i in stack.members], skip)
            for i in stacks.rest:
                m = layout[i]
                if "Q" in self.state[m.key]:
                    refresh_basis_(self.state[m.key], self._synced[id(m.key)].view(m.param.shape[0], -1), m.key, skip)
        finally:
            self._synced = None

    def _after_sync(self, slot: Slot, mean_delta: torch.Tensor) -> None:
        """This parameter's Δ̄, set aside for `_apply`'s refresh (outside `_apply`: refreshed now)."""
        if self._synced is not None:
            self._synced[id(slot.key)] = mean_delta
            return
        state = self.state[slot.key]
        if "Q" in state:
            refresh_basis_(state, mean_delta.view(slot.param.shape[0], -1), slot.key)
