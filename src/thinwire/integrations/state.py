"""Every rank's optimizer state in a checkpoint that one rank writes.

    state = PerRankState(optimizer)
    blob = state.state_dict()        # on every rank (a collective); each returns all ranks' states
    state.load_state_dict(blob)      # on every rank: each loads its own, by rank

Frameworks save the optimizer from rank 0 and load that one file on every rank. Dense
optimizers are the same on every rank, so nothing is lost; a thinwire optimizer's error
feedback, local momenta and diverged replicas differ per rank, and a resume would give every
rank rank 0's (DeepSpeed 1-bit Adam's resume bug). `PerRankState` is the object a framework
checkpoints beside the model: `state_dict()` all-gathers every rank's
`optimizer.state_dict()` (tensors moved to the CPU, so the checkpoint does not depend on the
device), `load_state_dict()` restores this rank's own. The all-gather goes through
torch.distributed's default group outside the optimizer's communicator: checkpoint traffic,
not training traffic, and not in `comm_stats`. Each rank holds all W states while saving.

LoRDO and DiLoCo (`PeriodicAveraging`): between synchronisations every rank's parameters
differ too, and a framework saves one replica. For them (or with `params=True`) the state
also holds each rank's own parameters, which `load_state_dict` copies back over the loaded
model: load the model first, then this (frameworks load custom objects after the model).

Another world size: a checkpoint of W ranks loads on W' ranks for a thinwire optimizer, each
new rank taking `thinwire.optim.elastic.remap` of the W saved states (the interval rule of
docs/design.md, "Elastic"; each rank's own parameters mixed by the same rule); a torch
optimizer's per-rank state is refused there.

Whose state: every entry carries an `identity` (thinwire.integrations.commit: rank, world,
run id, layout fingerprint). The run id is agreed on the first `state_dict()` of a fresh run
(one broadcast) and adopted from the checkpoint by `load_state_dict`; an entry on the wrong
rank, of another run (when this optimizer's run is known: it saved before, or a helper such
as `load_state` set it from the commit mark) or of another layout (a LoRDO state into a
DeMo run) is refused with a ValueError naming both, before anything changes. At another world
size only the optimizer's class is compared (the layout's description names the world).
Checkpoints written before identities existed are refused (`VERSION`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .commit import adopt_run_id, agree_run_id, check_identity, identity, rank_and_world, run_id

FORMAT = "thinwire-per-rank-optimizer-state"
VERSION = 2                      # 2: every entry carries its identity


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class PerRankState:
    """A checkpointable view of `optimizer` that keeps every rank's state (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: bool | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"PerRankState takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if params is None:
            from ..optim.periodic import PeriodicAveraging
            params = isinstance(optimizer, PeriodicAveraging)
        self.optimizer, self.params = optimizer, bool(params)
        self.source = "this PerRankState checkpoint"      # how refusals name the file (a helper sets it)

    def _own_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        """{"format", "version", "world", "run", "ranks": [rank r's optimizer.state_dict() for
        r < world], "identities": [rank r's identity]}; a collective: every rank calls it, every
        rank gets the whole."""
        rank, world = rank_and_world()
        run = agree_run_id(self.optimizer)
        mine = _to_cpu(self.optimizer.state_dict())
        if self.params:
            mine = {"optimizer": mine, "params": [_to_cpu(p) for p in self._own_params()]}
        entries = [(identity(self.optimizer, rank, world, run), mine)]
        if world > 1:
            entries = [None] * world
            dist.all_gather_object(entries, (identity(self.optimizer, rank, world, run), mine))
        return {"format": FORMAT, "version": VERSION, "world": world, "run": run,
                "ranks": [state for _, state in entries], "identities": [ident for ident, _ in entries]}

    def check(self, saved: dict) -> None:
        """ValueError, naming `self.source` and this rank, for a `saved` this rank must not load
        (module docstring); nothing changes."""
        rank, world = rank_and_world()
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ValueError("not a PerRankState checkpoint (no thinwire per-rank format marker)")
        if saved.get("version") != VERSION:
            raise ValueError(f"{self.source} was written by an older thinwire, without per-rank identities: "
                             f"whose state each entry is cannot be checked; resume it with that version")
        if not len(saved["ranks"]) == len(saved["identities"]) == saved["world"]:
            raise ValueError(f"{self.source} says {saved['world']} ranks but holds {len(saved['ranks'])} states")
        known = run_id(self.optimizer)            # None on a fresh resume: the checkpoint's run is taken
        if saved["world"] == world:
            mine = identity(self.optimizer, rank, world, known or saved["run"])
            check_identity(saved["identities"][rank], mine, self.source)
        elif saved["identities"][0]["optimizer"] != type(self.optimizer).__name__:
            raise ValueError(f"{self.source} holds {saved['identities'][0]['optimizer']} states; this run's "
                             f"optimizer is {type(self.optimizer).__name__}")
        elif known not in (None, saved["run"]):
            raise ValueError(f"{self.source} is of run {saved['run']}; this run is {known}")

    def load_state_dict(self, saved: dict) -> None:
        """Load this rank's own entry of `saved` (a `state_dict()`; of another world size: mapped
        by `remap`, module docstring) into the optimizer, and continue its run; ValueError for
        anything it cannot load (`check`), before the optimizer changes."""
        rank, world = rank_and_world()
        self.check(saved)
        own = saved["ranks"][rank] if saved["world"] == world else self._remapped(saved["ranks"], rank, world)
        if self.params != ("params" in own and "optimizer" in own):
            raise ValueError(f"this checkpoint was saved {'with' if not self.params else 'without'} each rank's "
                             f"parameters and this PerRankState is built {'with' if self.params else 'without'}")
        params = self._own_params()
        if self.params and [tuple(t.shape) for t in own["params"]] != [tuple(p.shape) for p in params]:
            raise ValueError("the checkpoint's parameters do not have this optimizer's parameter shapes")
        self.optimizer.load_state_dict(own["optimizer"] if self.params else own)
        adopt_run_id(self.optimizer, saved["run"])
        if self.params:
            with torch.no_grad():
                for p, saved_p in zip(params, own["params"]):
                    p.copy_(saved_p)

    def _remapped(self, ranks: list, rank: int, world: int) -> dict:
        """This rank's entry for a run of `world` ranks, mapped from the saved ranks' entries."""
        from ..optim.base import CommunicatingOptimizer
        from ..optim.elastic import mix, mixing_weights, remap
        if not isinstance(self.optimizer, CommunicatingOptimizer):
            raise ValueError(f"this checkpoint holds the optimizer state of {len(ranks)} ranks, this run has {world}: "
                             f"only a thinwire optimizer's per-rank state can be mapped onto another world size")
        with_params = all(isinstance(r, dict) and "params" in r and "optimizer" in r for r in ranks)
        states = [r["optimizer"] for r in ranks] if with_params else ranks
        mapped = remap(self.optimizer, states, rank)
        if not with_params:
            return mapped
        row = mixing_weights(len(ranks), world)[rank]
        params = [mix([r["params"][k] for r in ranks], row, f"parameter {k}") for k in range(len(ranks[0]["params"]))]
        return {"optimizer": mapped, "params": params}
