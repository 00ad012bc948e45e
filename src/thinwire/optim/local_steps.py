"""LocalSteps: a periodic optimizer whose local step is a torch optimizer's (`inner`), what
DiLoCo and SparseLoCo share; each composes it with its sync rule (`thinwire.optim.sync_rule`):

    θ ← inner.step(θ)               every step: local gradients, no communication (torch
                                    optimizers skip parameters without a gradient)
    the rule's sync                 every H-th step, after its local step (`thinwire.optim.periodic`)

The inner optimizer's groups are this object's groups (shared), so LR schedulers act on the
inner learning rate; new parameters join the inner optimizer. A fused torch inner optimizer
skips a bad local step on the device (`found_inf`, as under GradScaler). The state_dict is
{'inner': the inner optimizer's, 'outer': [self.state[p] per parameter: θ₀ and the rule's], and
the envelope's}; the elastic remap takes the inner state per rank and the outer by kind.

Two tiers (FSDP2 shards): the inner torch optimizer steps the DTensor parameters as it would
under FSDP2 alone; θ₀ and the sync run on this rank's shard.
"""

from __future__ import annotations

import torch

from .elastic_rules import PER_RANK, PERIODIC, param_state, torch_state
from .member import Member
from .periodic import PeriodicAveraging
from .sync_rule import SyncRule


class LocalSteps(PeriodicAveraging):
    """A torch inner optimizer's local steps and a sync rule (module docstring); a subclass
    checks its arguments and calls `_init_local_steps(...)`."""

    ELASTIC_KINDS = PERIODIC

    def _init_local_steps(self, params, inner, process_group, nonfinite: str, sync_every: int, sync: SyncRule,
                          overlap: bool, delay: int) -> None:
        """inner: callable params -> torch.optim.Optimizer (None: torch.optim.AdamW with its
        defaults); it receives `params` as given (tensors or groups)."""
        self.inner = torch.optim.AdamW(params) if inner is None else inner(params)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise ValueError(f"inner must build a torch.optim.Optimizer, got {type(self.inner).__name__}")
        self._sharing = True             # torch's __init__ adds the shared groups through add_param_group
        super().__init__(self.inner.param_groups, {})    # shared group dicts: schedulers reach inner
        self._sharing = False
        self._init_sync(process_group, nonfinite, sync_every, sync, overlap, delay)

    @property
    def STORE_EXCHANGE(self) -> bool:             # noqa: N802 (the class attribute of the other optimizers)
        """The rule's: one GatherAll whose `keep_own` keeps a message that missed a store round."""
        return self.sync.STORE_EXCHANGE

    def _keep_own(self, step: int, layout: list[Member], exchange) -> None:
        self.sync.keep_own(self, step, layout, exchange)

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
                             f"parameters, this {type(self).__name__} has {len(params)}")
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups       # re-share the inner's new group dicts
        for p, saved in zip(params, outer):
            self.state[p] = {k: (v.to(p.device).clone() if torch.is_tensor(v) else v) for k, v in saved.items()}
        self._load_envelope_state(state_dict)
