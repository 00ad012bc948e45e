"""DiLoCo: H local steps of any optimizer, then an outer Nesterov step on the averaged
pseudo-gradient (Douillard et al., arXiv 2311.08105; torchft `DiLoCo`, OpenDiLoCo).

On every rank, with θ₀ the parameters all ranks agreed on at the last sync (the anchor):

    θ ← inner.step(θ)                               every step: local gradients, no communication
    Δ̄ = mean_ranks (θ − θ₀)                        every H-th step, after its local step: one
                                                    collective of one flat buffer
    g = −Δ̄                                          the pseudo-gradient, mean_ranks (θ₀ − θ)
    b ← μ b + g                                     outer momentum (torch SGD, dampening 0)
    θ₀ ← θ₀ − η_out (g + μ b)                       Nesterov; defaults η_out = 0.7, μ = 0.9
    θ ← θ₀                                          every rank leaves the sync bit-identical

The sync is `PeriodicAveraging`'s, which LoRDO shares: its wire formats, what non-finite
gradients do, and overlap (streaming DiLoCo's delayed outer step) are in
`thinwire.optim.periodic`.

The inner optimizer's groups are this object's groups (shared), so LR schedulers act on
the inner learning rate. Between syncs replicas differ by design; right after each sync
they are bit-identical.

Two tiers (FSDP2 shards, `process_group` = the group across sites): the inner torch optimizer
steps the DTensor parameters as it would under FSDP2 alone; Δ, θ₀, the outer step and the
sync run on this rank's shard, exchanged with the ranks holding it in the other sites.
"""

from __future__ import annotations

import torch

from .base import Member
from .elastic_rules import PER_RANK, PERIODIC, param_state, torch_state
from .periodic import PeriodicAveraging, check_delay, check_outer, check_sync_every, check_wire


class DiLoCo(PeriodicAveraging):
    """DiLoCo over any inner optimizer; see the module docstring for the equations.

    Args:
        inner: callable params -> torch.optim.Optimizer (default: torch.optim.AdamW with its
            defaults, lr 1e-3); it receives `params` as given (tensors or groups).
        sync_every: H, local steps between syncs (default 32; papers use 20-500).
        outer_lr, outer_momentum: Nesterov outer SGD (defaults 0.7 and 0.9, as published).
        wire: 'fp32' (default) | 'bf16' | 'int8' for the pseudo-gradient, with error feedback.
            'bf16' and 'int8' may go through the store (`process_group=StoreGroup(...)`).
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite; see
            `thinwire.optim.periodic`. With a fused inner optimizer (`inner=lambda p:
            torch.optim.AdamW(p, fused=True)`) a bad local step is skipped on the device
            (`found_inf`) and no local step reads the host; with 'skip' the fp32 sync (delay 1)
            reads nothing either (`thinwire.optim.verdict`).
        overlap: True leaves each sync's exchange in flight until the next step() (the
            delayed outer step of `thinwire.optim.periodic`).
        delay: with overlap, the steps a sync stays in flight (default 1; at most sync_every):
            it lands at the start of that many steps later, and each replica keeps the local
            steps it made meanwhile (`thinwire.optim.periodic`).
    Initial parameters must be identical on all ranks (as with DDP's broadcast).
    """

    kind = "diloco"

    @property
    def STORE_EXCHANGE(self) -> bool:             # noqa: N802 (the class attribute of the other optimizers)
        """The lossy wires are one GatherAll and e ← x keeps a message that missed (`_keep_own`);
        'fp32' is an all_reduce, which the store does not carry."""
        return self.wire != "fp32"

    def _keep_own(self, step: int, layout: list[Member], exchange) -> None:
        """This rank's sync message missed the store round: the landing commits e ← x = Δ + e
        (exactly what it encoded) instead of x − decode(encode(x)), so its whole Δ goes out
        with the next sync; θ₀ and θ move with the others' messages, as on every site."""
        n = sum(m.param.numel() for m in layout)
        self._unsent[:n].copy_(self._x[:n])

    def __init__(self, params, inner=None, sync_every: int = 32, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, wire: str = "fp32", nonfinite: str = "raise", process_group=None,
                 overlap: bool = False, delay: int = 1):
        check_sync_every(sync_every)
        check_outer(outer_lr, outer_momentum)
        check_wire(wire)
        check_delay(delay, sync_every, overlap)
        self.inner = torch.optim.AdamW(params) if inner is None else inner(params)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise ValueError(f"inner must build a torch.optim.Optimizer, got {type(self.inner).__name__}")
        self._sharing = True             # torch's __init__ adds the shared groups through add_param_group
        super().__init__(self.inner.param_groups, {})    # shared group dicts: schedulers reach inner
        self._sharing = False
        self._init_sync(process_group, nonfinite, sync_every, outer_lr, outer_momentum, wire, overlap, delay)

    def _masks_nonfinite(self, layout: list[Member]) -> bool:
        """A fused torch inner optimizer skips a step on the device (`found_inf`, as under
        GradScaler): then no step reads this rank's gradients' finiteness on the host."""
        return bool(self.inner.defaults.get("fused")) and getattr(self.inner, "_step_supports_amp_scaling", False)

    def _local_step(self, step: int, layout: list[Member]) -> None:
        # θ ← inner.step(θ)   (torch optimizers skip parameters without a gradient)
        if self.gradients_nonfinite is None:
            self.inner.step()
            return
        self.inner.found_inf = self.gradients_nonfinite.to(torch.float32)   # 1.0: θ and its state stay
        try:
            self.inner.step()
        finally:
            del self.inner.found_inf

    def add_param_group(self, param_group: dict) -> None:
        """New parameters join the inner optimizer (its defaults fill the group)."""
        if self._sharing:
            return super().add_param_group(param_group)
        self.inner.add_param_group(param_group)
        self.param_groups = self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    ELASTIC_KINDS = PERIODIC

    def _elastic_state(self, states: list[dict], row: torch.Tensor, rank: int) -> dict:
        """The inner optimizer's state (every key per rank: each replica's own), the outer one by kind."""
        inner = torch_state(self.inner, [s["inner"] for s in states], row, {"*": PER_RANK}, False, "inner")
        outers, params = [s["outer"] for s in states], self.params
        if any(not isinstance(o, list) or len(o) != len(params) for o in outers):
            raise ValueError(f"outer: a state holds outer state for {[len(o) for o in outers]} parameters, this "
                             f"{type(self).__name__} has {len(params)}")
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        return {"inner": inner, "outer": [param_state(self, group_of[id(p)], p, [o[n] for o in outers], row,
                                                      self.ELASTIC_KINDS, False, f"outer of parameter {n}")
                                          for n, p in enumerate(params)]}

    def state_dict(self):
        outer = [dict(self.state[p]) for p in self.params]
        return {"inner": self.inner.state_dict(), "outer": outer, **self._envelope_state()}

    def load_state_dict(self, state_dict) -> None:
        params = self.params
        outer = state_dict.get("outer")
        if outer is None or len(outer) != len(params):
            raise ValueError(f"state_dict holds outer state for {0 if outer is None else len(outer)} "
                             f"parameters, this DiLoCo has {len(params)}")
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups       # re-share the inner's new group dicts
        for p, saved in zip(params, outer):
            self.state[p] = {k: (v.to(p.device).clone() if torch.is_tensor(v) else v) for k, v in saved.items()}
        self._load_envelope_state(state_dict)
