"""Elastic: resume a run of W ranks on W' ranks (flat: one process group; two tiers: W sites on W').

    A = mixing_weights(W, W')                         [W', W] float64
    state = remap(optimizer, [sd_0, ..., sd_{W-1}], rank)   sd_i: old rank i's state_dict()
    optimizer.load_state_dict(state)                  optimizer: built on the W'-rank group

The interval rule, for every per-rank quantity X (error feedback, local momenta, worker
estimates, inner optimizer states, diverged replicas): lay the old ranks on [0, 1) as W
equal intervals and the new ones as W' intervals; new rank j takes the length-weighted
average of the old states its interval overlaps,

    A[j, i] = W' · |[j/W', (j+1)/W') ∩ [i/W, (i+1)/W)|,      X'_j = Σ_i A[j, i] X_i.

Rows sum to 1, so each X'_j is a convex combination (safe for parameters, momenta and
second moments: non-negative stays non-negative); columns sum to W'/W, so the mean over
ranks is preserved exactly, (1/W') Σ_j X'_j = (1/W) Σ_i X_i. That mean is what every
algorithm reads: DeMo's and APMSqueeze's error feedback enter the update through the mean
over ranks (no unsent momentum is lost or duplicated in total); EF21's invariant "server
estimate G = mean_j G_j" survives; LoRDO / DiLoCo's sync reads mean_i (θ_i − θ₀), so
averaging replicas is what the next sync would do. W' = W is the identity (remap returns the
rank's own state as saved, a step in flight included, after the checks), W → W/2 averages
neighbours (contiguous ranks: a site's), W → 2W copies each rank's state to two ranks.
Model parameters are no optimizer state: where replicas drift (LoRDO, DiLoCo between syncs)
the caller mixes each rank's own the same way, `mix(values, mixing_weights(W, W')[rank], name)`.

Other kinds of state: replicated state (the same on every rank: Adam moments under a mean
gradient, anchors, outer momenta, LoRDO's basis, param groups) must be equal on all old
ranks (ValueError otherwise) and is kept as it is; APMSqueeze's server error (rank c holds
chunk c of the averaged vector, padded to a multiple of 8W) is concatenated, cut to the
parameters' length (the padding's error feeds back only into coordinates no parameter
has) and re-split into W' chunks after padding to a multiple of 8W': exact, not mixed,
because it is one error of one vector, not a per-rank quantity; EF21-Muon's server state
(G, X) stays on rank 0 (topology='replicated': on every rank, as replicated state). Step
counters must agree. Byte counters are per-rank history: mixed by the same rule and rounded,
so the mean bytes per rank carry on. An integer per-rank value (LoRDO's local step count) is
mixed and rounded; it differs between ranks only after a skipped local step.

A step in flight (`overlap=True`, `InFlight` in checkpoints.py; elastic_flight.py) belongs
to the old exchange and is folded back so nothing is lost: DeMo's sent part returns to the momentum (M ← M +
α T⁻¹(Q̂_i), as for a flagged step) and the momentum keeps the gradient; EF21-Muon commits
the new momentum M_j⁺ but not G_j (the server never got R_j, so G = mean G_j still holds and
R_j is sent again from M_j⁺ − G_j); LoRDO / DiLoCo drop the sync (anchor, outer momentum and
sync error unchanged, Δ_i still in the replica: the next sync carries it). In all three the
step count stays at the last step landed, so the next step() takes the folded step's number.
DenseAllReduce and APMSqueeze's warmup checkpoint the all-reduced sum of the W gradients
(the same on every rank): it stays in flight, scaled by W'/W, so the new ranks' mean (sum / W')
is the old one and the trailer's counts (lockstep slot W → W', presence > 0) stay valid; the
step lands on the new world as it would have on the old. Refused (flush() before the
checkpoint): APMSqueeze's compressed phase, whose message m_i = β1 m̄ + (1 − β1) g_i has no
local state to return to and whose start already moved the worker error, and a lookahead
(the model holds moved parameters).

Two tiers (FSDP2 shards inside a site, `process_group` = the group across sites): W and W'
are the numbers of sites, and `states` the old ranks that held this rank's shard, one per old
site in site order (the same ranks per site, so the same shard: train/remap.py picks them);
`rank` is this rank's site. Every per-rank quantity is then a shard's, mapped elementwise as
above; APMSqueeze's server error is partitioned over the cross-site group, EF21's server is
the group's rank 0 (site 0), and shapes are checked against this rank's shard.

Refused, with ValueError naming what differs: another optimizer class, other param groups
or hyperparameters (lr and initial_lr excepted: schedulers move them), other parameter
counts or shapes (a shard's: other ranks per site), replicated state that differs between
old ranks. Settings a state_dict does not record (EF21's compressors and topology, the wire)
cannot be compared here; the handshake after the load checks only that the new ranks agree.
"""

from __future__ import annotations

import torch

from ..comm.collectives import padded_numel
from .apmsqueeze import ERRORS_KEY, APMSqueeze
from .base import CommunicatingOptimizer
from .checkpoints import INFLIGHT_KEY, STATS_KEY, STEP_KEY
from .demo import DeMo, momentum_in_transform
from .dense import DenseAllReduce
from .diloco import DiLoCo
from .ef21_muon import EF21Muon
from .elastic_flight import fold_in_flight, rescaled_sum
from .lordo import LoRDO
from .shards import is_dtensor, like, local_view

PER_RANK, REPLICATED, SERVER = "per-rank", "replicated", "server"
SCHEDULED = ("lr", "initial_lr")          # a scheduler moves these: the saved values win, as in torch
PERIODIC = {"anchor": REPLICATED, "outer_momentum": REPLICATED, "sync_error": PER_RANK,
            "error": PER_RANK}           # SparseLoCo (a DiLoCo): its error feedback e, a per-rank residual
# what each optimizer's per-parameter state is; "*": any other key (a wrapped torch optimizer's)
KINDS = [(DeMo, {"momentum": PER_RANK}),
         (APMSqueeze, {"*": REPLICATED}),           # Adam moments of the mean gradient / m̄
         (EF21Muon, {"momentum": PER_RANK, "estimate": PER_RANK, "server_estimate": SERVER, "server_model": SERVER}),
         (LoRDO, {**PERIODIC, "Q": REPLICATED, "*": PER_RANK}),
         (DiLoCo, PERIODIC),                        # its inner optimizer: every key per rank
         (DenseAllReduce, {"*": REPLICATED})]       # every rank steps on the same mean gradient


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


def remap(optimizer: CommunicatingOptimizer, states: list[dict], rank: int) -> dict:
    """`states[i]` is old rank i's `optimizer.state_dict()` (a run of len(states) ranks, same optimizer class,
    hyperparameters and parameter shapes); returns the state_dict that `optimizer` (this run's, already
    built on the new process group: its world size is W', its rank `rank`) should `load_state_dict`.
    Two tiers: old rank i is the one of old site i that held this rank's shard, `rank` this rank's site.
    ValueError naming what differs for anything it cannot map (another optimizer, other shapes, ...)."""
    kinds = _check_call(optimizer, states, rank)
    if len(states) == optimizer.comm.world_size:    # the identity: checked, then this rank's own state as saved
        _mapped(optimizer, [{k: v for k, v in s.items() if k != INFLIGHT_KEY} for s in states], rank, kinds)
        return dict(states[rank])
    return _mapped(optimizer, states, rank, kinds)


def _mapped(optimizer, states: list[dict], rank: int, kinds: dict) -> dict:
    """`remap` for another world size: the interval rule, key by key, by each state's kind."""
    new = optimizer.comm.world_size
    row = mixing_weights(len(states), new)[rank]
    if not isinstance(optimizer, (DiLoCo, DenseAllReduce)):     # before a fold reads them with this optimizer's
        _expect_keys(states, "state", "param_groups")
        for i, s in enumerate(states):
            _check_groups(optimizer.param_groups, s["param_groups"], f"states[{i}]")
    carried = rescaled_sum(optimizer, states, new)
    states = [fold_in_flight(optimizer, s, i) for i, s in enumerate(states)]
    if isinstance(optimizer, DiLoCo):
        out = {"inner": _torch_state(optimizer.inner, [s["inner"] for s in states], row, {"*": PER_RANK}, False,
                                     "inner"),
               "outer": _outer_state(optimizer, [s["outer"] for s in states], row)}
    elif isinstance(optimizer, DenseAllReduce):
        _expect_keys(states, "optimizers")
        if any(len(s["optimizers"]) != len(optimizer.optimizers) for s in states):
            raise ValueError(f"a state wraps {len(states[0]['optimizers'])} optimizers, this DenseAllReduce "
                             f"wraps {len(optimizer.optimizers)}")
        out = {"optimizers": [_torch_state(inner, [s["optimizers"][k] for s in states], row, kinds, False,
                                           f"optimizers[{k}]") for k, inner in enumerate(optimizer.optimizers)]}
    else:
        server = getattr(optimizer, "is_server", False)
        out = _torch_state(optimizer, states, row, kinds, server, "state")
        if isinstance(optimizer, APMSqueeze):
            out[ERRORS_KEY] = _apmsqueeze_errors(optimizer, states, row, rank)
    out.update(_envelope(states, row))
    if carried is not None:
        out[INFLIGHT_KEY] = carried
    return out


def _check_call(optimizer, states, rank) -> dict:
    """The policy of `optimizer`'s class, after checking the arguments and the layout."""
    kinds = next((k for cls, k in KINDS if isinstance(optimizer, cls)), None)
    if kinds is None:
        raise ValueError(f"optimizer: no elastic policy for {type(optimizer).__name__} (known: "
                         f"{', '.join(cls.__name__ for cls, _ in KINDS)})")
    if not isinstance(states, (list, tuple)) or not states or not all(isinstance(s, dict) for s in states):
        raise ValueError("states must be a non-empty list of state_dicts, one per old rank")
    new = optimizer.comm.world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < new:
        raise ValueError(f"rank must be an integer in [0, {new}) (this optimizer's world size), got {rank!r}")
    return kinds


def _expect_keys(states: list[dict], *keys: str) -> None:
    for i, s in enumerate(states):
        missing = [k for k in keys if k not in s]
        if missing:
            raise ValueError(f"states[{i}] lacks {missing} (it has {sorted(s)}): another optimizer's state_dict?")


def _check_groups(live: list[dict], saved: list[dict], what: str) -> None:
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


def _expected_numel(optimizer, group: dict, p: torch.Tensor, key: str, per_param: dict) -> int | None:
    """The element count state `key` of parameter p must have (None: not checked)."""
    if isinstance(optimizer, DeMo) and momentum_in_transform(group):
        return optimizer.compressor(group).plan(p.shape).padded_numel      # coefficients, padding included
    if isinstance(optimizer, LoRDO) and "Q" in per_param and key in ("Q", "exp_avg", "exp_avg_sq"):
        return None                                                        # low-rank: the rank's shape
    return p.numel() if torch.is_tensor(per_param[key]) and per_param[key].dim() else None


def _param_state(optimizer, group, p, dicts: list[dict], row, kinds: dict, server: bool, what: str) -> dict:
    """One parameter's new state from every old rank's (`dicts`), key by key, by its kind. Under
    FSDP2 shapes are this rank's shard's; a torch optimizer's DTensor state (DiLoCo's inner
    AdamW on shards) is mapped on its local shards and placed as the live parameter is."""
    out, local = {}, local_view(p)
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
        _check_shapes(_expected_numel(optimizer, group, local, key, dicts[having[0]]), local, values, name)
        if kind == PER_RANK:
            out[key] = mix(values, row, name)
        elif kind == REPLICATED or server:          # SERVER: kept where the server runs
            out[key] = replicated(values, name)
        if sharded and key in out:
            out[key] = like(p, out[key])
    return out


def _check_shapes(want: int | None, p: torch.Tensor, values: list, name: str) -> None:
    """Every old rank's tensor shaped alike, with the element count parameter p needs (`want`)."""
    shapes = [tuple(v.shape) for v in values if torch.is_tensor(v)]
    if len(set(shapes)) > 1:
        raise ValueError(f"{name} has shapes {shapes} on the old ranks: not one run's states?")
    if shapes and want is not None and values[0].numel() != want:
        raise ValueError(f"{name} has shape {shapes[0]} ({values[0].numel()} elements), but this optimizer's "
                         f"parameter has shape {tuple(p.shape)}: other parameter shapes?")


def _torch_state(optimizer, states: list[dict], row, kinds: dict, server: bool, what: str) -> dict:
    """A torch-style {'state', 'param_groups'} state_dict mapped parameter by parameter."""
    _expect_keys(states, "state", "param_groups")
    groups = replicated([s["param_groups"] for s in states], f"{what} param_groups")
    _check_groups(optimizer.param_groups, groups, what)
    params = [(g, p) for g in optimizer.param_groups for p in g["params"]]
    ids = [pid for g in groups for pid in g["params"]]
    out = {}
    for pid, (group, p) in zip(ids, params):
        dicts = [s["state"].get(pid, {}) for s in states]
        if any(dicts):
            out[pid] = _param_state(optimizer, group, p, dicts, row, kinds, server, f"{what} of parameter {pid}")
    extra = set(k for s in states for k in s["state"]) - set(ids)
    if extra:
        raise ValueError(f"{what} holds state for parameter ids {sorted(extra)}, which this optimizer lacks")
    return {"state": out, "param_groups": [dict(g) for g in groups]}


def _outer_state(optimizer: DiLoCo, outers: list, row) -> list[dict]:
    params = optimizer.params
    if any(not isinstance(o, list) or len(o) != len(params) for o in outers):
        raise ValueError(f"outer: a state holds outer state for {[len(o) for o in outers]} parameters, this "
                         f"DiLoCo has {len(params)}")
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return [_param_state(optimizer, group_of[id(p)], p, [o[n] for o in outers], row, PERIODIC, False,
                         f"outer of parameter {n}") for n, p in enumerate(params)]


def _apmsqueeze_errors(optimizer: APMSqueeze, states: list[dict], row, rank: int) -> dict:
    """δ_i by the interval rule (cut to the parameters, re-padded for W'); δ̄ re-partitioned."""
    _expect_keys(states, ERRORS_KEY)
    saved = [s[ERRORS_KEY] for s in states]
    for what in ("warmup_steps", "phase"):
        replicated([e[what] for e in saved], f"APMSqueeze {what}")
    if saved[0]["warmup_steps"] != optimizer.warmup_steps:
        raise ValueError(f"warmup_steps: the state has {saved[0]['warmup_steps']}, this APMSqueeze "
                         f"{optimizer.warmup_steps}")
    new = optimizer.comm.world_size
    out = {"world_size": new, "rank": rank, "phase": saved[0]["phase"], "warmup_steps": optimizer.warmup_steps,
           "worker_error": None, "server_error": None}
    if all(e["worker_error"] is None for e in saved):
        return out                                                   # warmup: no errors yet
    numel, old = sum(m.param.numel() for m in optimizer.layout()), len(saved)
    for i, e in enumerate(saved):
        if e["worker_error"] is None or (e["world_size"], e["rank"]) != (old, i) \
                or e["worker_error"].numel() != padded_numel(numel, old):
            raise ValueError(f"states[{i}]: APMSqueeze errors of rank {e['rank']} of {e['world_size']} for "
                             f"{None if e['worker_error'] is None else e['worker_error'].numel()} elements; "
                             f"expected rank {i} of {old} for {numel} parameters' elements, padded")
    # δ'_j = Σ_i A[j, i] δ_i on the parameters' elements; the padding restarts at 0
    worker = torch.zeros(padded_numel(numel, new), dtype=torch.float32, device=saved[0]["worker_error"].device)
    worker[:numel] = mix([e["worker_error"][:numel] for e in saved], row, "APMSqueeze worker_error")
    out["worker_error"] = worker
    out["server_error"] = repartition([e["server_error"] for e in saved], numel, new, rank)
    return out


def _envelope(states: list[dict], row) -> dict:
    """The step count (must agree) and the byte counters (mixed: per-rank history)."""
    out = {STEP_KEY: replicated([int(s.get(STEP_KEY, 0)) for s in states], "the step count")}
    stats = [s.get(STATS_KEY) for s in states]
    if all(x is not None for x in stats):
        def counters(rows: list[dict], what: str) -> dict:
            return {k: mix([r.get(k, 0) for r in rows], row, what) for k in sorted({k for r in rows for k in r})}
        tags = sorted({t for x in stats for t in x["by_tag"]})
        out[STATS_KEY] = {"totals": counters([x["totals"] for x in stats], "comm totals"),
                          "steps": replicated([x["steps"] for x in stats], "the comm stats' step count"),
                          "last_step": counters([x["last_step"] for x in stats], "comm last_step"),
                          "by_tag": {t: counters([x["by_tag"].get(t, {}) for x in stats], f"comm {t}")
                                     for t in tags}}
    return out
