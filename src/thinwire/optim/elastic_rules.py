"""The elastic remap's rules, below the optimizers: each optimizer declares how its state
crosses a change of world size (`ElasticRule`, inherited by every thinwire optimizer) with
these helpers; `thinwire.optim.elastic` (its docstring holds the interval rule and the kinds'
meaning) applies the declarations without knowing any optimizer by name.

    ELASTIC_KINDS = {"momentum": PER_RANK}            a class attribute: state key -> kind
    A = mixing_weights(W, W')                         [W', W] float64
    mix(values, A[j], what)                           X'_j = Σ_i A[j, i] X_i
"""

from __future__ import annotations

import torch

from ..comm.collectives import padded_numel
from .shards import is_dtensor, like, local_view

PER_RANK, REPLICATED, SERVER = "per-rank", "replicated", "server"
SCHEDULED = ("lr", "initial_lr")          # a scheduler moves these: the saved values win, as in torch
# DiLoCo's, LoRDO's and SparseLoCo's per-parameter sync state
PERIODIC = {"anchor": REPLICATED, "outer_momentum": REPLICATED, "sync_error": PER_RANK,
            "error": PER_RANK}           # SparseLoCo: its error feedback e, a per-rank residual


class ElasticRule:
    """An optimizer's declaration of how its state is remapped onto another world size
    (`thinwire.optim.elastic.remap`): `ELASTIC_KINDS` for a torch-shaped state_dict; the hooks
    below where the state or a step in flight needs more. Defaults: every key of a torch-style
    {'state', 'param_groups'} by its kind, no step in flight."""

    ELASTIC_KINDS: dict[str, str] = {}
    """Per-parameter state key -> PER_RANK, REPLICATED or SERVER; "*": any other key. Empty: the
    optimizer cannot be remapped (remap raises ValueError naming it)."""

    def _elastic_numel(self, group: dict, p: torch.Tensor, key: str, per_param: dict) -> int | None:
        """The element count state `key` of parameter p must have (None: not checked)."""
        return p.numel() if torch.is_tensor(per_param[key]) and per_param[key].dim() else None

    def _elastic_state(self, states: list[dict], row: torch.Tensor, rank: int) -> dict:
        """The new rank's state_dict from every old rank's (step in flight already folded), before
        the envelope's step count and byte counters are added."""
        check_torch_states(self, states)
        return torch_state(self, states, row, self.ELASTIC_KINDS, False, "state")

    def _elastic_sums(self, step: int) -> bool:
        """Whether the exchange of `step` is a sum all-reduce, the same on every rank: kept in
        flight, rescaled for W' ranks (`thinwire.optim.elastic_flight.rescaled_sum`)."""
        return False

    def _elastic_fold(self, state: dict, record: dict, refuse: str) -> dict:
        """Old rank's `state` with its step in flight (`record`) folded back, so nothing it
        computed is lost; default: refused (its message has no local state to return to)."""
        raise ValueError(f"{refuse}: {type(self).__name__}'s message has no local state to return to; "
                         "flush() before the checkpoint to resume it on another world size")


def layout_ids(optimizer) -> list[int]:
    """The state_dict ids (positions in param-group order) of the layout's parameters."""
    return [i for i, p in enumerate(optimizer.params) if p.requires_grad and p.numel()]


def mixing_weights(old_world: int, new_world: int) -> torch.Tensor:
    """[new_world, old_world] float64 weights A: new rank j's per-rank state is sum_i A[j, i] * old rank i's."""
    for name, w in (("old_world", old_world), ("new_world", new_world)):
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {w!r}")
    a = torch.zeros(new_world, old_world, dtype=torch.float64)
    for j in range(new_world):
        for i in range(old_world):
            # in units of 1/(W W'): new interval [j W, (j+1) W), old [i W', (i+1) W')
            units = min((j + 1) * old_world, (i + 1) * new_world) - max(j * old_world, i * new_world)
            # A[j, i] = W' · units / (W W') = units / W
            a[j, i] = max(units, 0) / old_world
    return a


def mix(values: list, row: torch.Tensor, what: str):
    """Σ_i row[i] · values[i] (the interval rule for one new rank); values that agree wherever
    row > 0 come back exactly; tensors in float64, cast back; integers rounded."""
    used = [v for v, w in zip(values, row.tolist()) if w > 0]
    if all(_same(v, used[0]) for v in used[1:]):
        return used[0].clone() if torch.is_tensor(used[0]) else used[0]
    first = used[0]
    if torch.is_tensor(first) and first.is_floating_point():
        # X'_j = Σ_i A[j, i] X_i
        total = sum(w * v.to(torch.float64) for v, w in zip(values, row.tolist()) if w > 0)
        return total.to(first.dtype)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        total = sum(w * v for v, w in zip(values, row.tolist()) if w > 0)
        return round(total) if isinstance(first, int) else total
    raise ValueError(f"{what} differs between old ranks and cannot be mixed ({type(first).__name__})")


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype \
            and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def replicated(values: list, what: str):
    """The value every old rank holds (ValueError naming `what` when they differ)."""
    for i, v in enumerate(values[1:], 1):
        if not _same(v, values[0]):
            raise ValueError(f"{what} differs between old rank 0 and old rank {i}, but it must be the same on "
                             "every rank: were these state_dicts saved by one run at one step?")
    return values[0].clone() if torch.is_tensor(values[0]) else values[0]


def repartition(chunks: list[torch.Tensor], numel: int, new_world: int, rank: int) -> torch.Tensor:
    """New rank `rank`'s chunk of a vector split in rank order into `chunks`: concatenated, cut
    to its `numel` meaningful elements, zero-padded to padded_numel(numel, W'), split into W'."""
    whole = torch.cat(chunks)[:numel]
    n = padded_numel(numel, new_world)
    size = n // new_world
    out = torch.zeros(size, dtype=whole.dtype, device=whole.device)
    part = whole[rank * size: (rank + 1) * size]
    out[: part.numel()].copy_(part)
    return out


def expect_keys(states: list[dict], *keys: str) -> None:
    for i, s in enumerate(states):
        missing = [k for k in keys if k not in s]
        if missing:
            raise ValueError(f"states[{i}] lacks {missing} (it has {sorted(s)}): another optimizer's state_dict?")


def check_torch_states(optimizer, states: list[dict]) -> None:
    """Every old rank's state torch-shaped, with `optimizer`'s param groups (read before a fold
    reads them with this optimizer's layout)."""
    expect_keys(states, "state", "param_groups")
    for i, s in enumerate(states):
        check_groups(optimizer.param_groups, s["param_groups"], f"states[{i}]")


def check_groups(live: list[dict], saved: list[dict], what: str) -> None:
    """Param groups: as many, as many parameters each, the same hyperparameters (SCHEDULED excepted)."""
    if len(live) != len(saved):
        raise ValueError(f"{what}: the state has {len(saved)} param groups, this optimizer {len(live)}")
    for n, (g, s) in enumerate(zip(live, saved)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(f"{what}: param group {n} holds {len(s['params'])} parameters in the state, "
                             f"{len(g['params'])} here")
        keys = (set(g) | set(s)) - {"params", *SCHEDULED}
        differ = sorted(k for k in keys if k not in g or k not in s or not _same(g[k], s[k]))
        if differ:
            raise ValueError(f"{what}: param group {n} differs in {', '.join(differ)} (state: "
                             f"{ {k: s.get(k) for k in differ} }, here: { {k: g.get(k) for k in differ} })")


def param_state(optimizer, group, p, dicts: list[dict], row, kinds: dict, server: bool, what: str) -> dict:
    """One parameter's new state from every old rank's (`dicts`), key by key, by its kind. Under
    FSDP2 shapes are this rank's shard's; a torch optimizer's DTensor state (DiLoCo's inner
    AdamW on shards) is mapped on its local shards and placed as the live parameter is."""
    out, local = {}, local_view(p)
    rule = optimizer if isinstance(optimizer, ElasticRule) else ElasticRule()     # a wrapped torch optimizer's
    for key in sorted({k for d in dicts for k in d}, key=str):
        kind, name = kinds.get(key, kinds.get("*")), f"{what} '{key}'"
        having = [i for i, d in enumerate(dicts) if key in d]
        if kind is None:
            raise ValueError(f"{name}: no elastic policy for this state key of {type(optimizer).__name__}")
        if kind != SERVER and len(having) != len(dicts):
            raise ValueError(f"{name} is on old ranks {having} only, but it belongs on every rank")
        values = [dicts[i][key] for i in having]
        sharded = is_dtensor(values[0]) and is_dtensor(p)
        values = [v.to_local() if is_dtensor(v) else v for v in values]
        check_shapes(rule._elastic_numel(group, local, key, dicts[having[0]]), local, values, name)
        if kind == PER_RANK:
            out[key] = mix(values, row, name)
        elif kind == REPLICATED or server:          # SERVER: kept where the server runs
            out[key] = replicated(values, name)
        if sharded and key in out:
            out[key] = like(p, out[key])
    return out


def check_shapes(want: int | None, p: torch.Tensor, values: list, name: str) -> None:
    """Every old rank's tensor shaped alike, with the element count parameter p needs (`want`)."""
    shapes = [tuple(v.shape) for v in values if torch.is_tensor(v)]
    if len(set(shapes)) > 1:
        raise ValueError(f"{name} has shapes {shapes} on the old ranks: not one run's states?")
    if shapes and want is not None and values[0].numel() != want:
        raise ValueError(f"{name} has shape {shapes[0]} ({values[0].numel()} elements), but this optimizer's "
                         f"parameter has shape {tuple(p.shape)}: other parameter shapes?")


def torch_state(optimizer, states: list[dict], row, kinds: dict, server: bool, what: str) -> dict:
    """A torch-style {'state', 'param_groups'} state_dict mapped parameter by parameter."""
    expect_keys(states, "state", "param_groups")
    groups = replicated([s["param_groups"] for s in states], f"{what} param_groups")
    check_groups(optimizer.param_groups, groups, what)
    params = [(g, p) for g in optimizer.param_groups for p in g["params"]]
    ids = [pid for g in groups for pid in g["params"]]
    out = {}
    for pid, (group, p) in zip(ids, params):
        dicts = [s["state"].get(pid, {}) for s in states]
        if any(dicts):
            out[pid] = param_state(optimizer, group, p, dicts, row, kinds, server, f"{what} of parameter {pid}")
    extra = set(k for s in states for k in s["state"]) - set(ids)
    if extra:
        raise ValueError(f"{what} holds state for parameter ids {sorted(extra)}, which this optimizer lacks")
    return {"state": out, "param_groups": [dict(g) for g in groups]}


