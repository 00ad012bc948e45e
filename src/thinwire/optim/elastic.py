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

Each optimizer declares its own rule where it is defined (`thinwire.optim.elastic_rules.
ElasticRule`: `ELASTIC_KINDS`, its state keys' kinds, and hooks where its state_dict is not
torch-shaped or a step in flight can be folded back); this module applies the declarations and
names no optimizer.

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

from .checkpoints import INFLIGHT_KEY, STATS_KEY, STEP_KEY
from .elastic_flight import fold_in_flight, rescaled_sum
from .elastic_rules import ElasticRule, mix, mixing_weights, replicated

__all__ = ["mix", "mixing_weights", "remap", "replicated"]


def remap(optimizer: ElasticRule, states: list[dict], rank: int) -> dict:
    """`states[i]` is old rank i's `optimizer.state_dict()` (a run of len(states) ranks, same optimizer class,
    hyperparameters and parameter shapes); returns the state_dict that `optimizer` (this run's, already
    built on the new process group: its world size is W', its rank `rank`) should `load_state_dict`.
    Two tiers: old rank i is the one of old site i that held this rank's shard, `rank` this rank's site.
    ValueError naming what differs for anything it cannot map (another optimizer, other shapes, ...)."""
    _check_call(optimizer, states, rank)
    if len(states) == optimizer.comm.world_size:    # the identity: checked, then this rank's own state as saved
        _mapped(optimizer, [{k: v for k, v in s.items() if k != INFLIGHT_KEY} for s in states], rank)
        return dict(states[rank])
    return _mapped(optimizer, states, rank)


def _mapped(optimizer: ElasticRule, states: list[dict], rank: int) -> dict:
    """`remap` for another world size: the interval rule, key by key, by each state's kind (the
    optimizer's declaration: `ElasticRule`)."""
    new = optimizer.comm.world_size
    row = mixing_weights(len(states), new)[rank]
    carried = rescaled_sum(optimizer, states, new)
    states = [fold_in_flight(optimizer, s, i) for i, s in enumerate(states)]
    out = optimizer._elastic_state(states, row, rank)
    out.update(_envelope(states, row))
    if carried is not None:
        out[INFLIGHT_KEY] = carried
    return out


def _check_call(optimizer, states, rank) -> None:
    """The arguments, and that `optimizer` declares an elastic rule."""
    if not isinstance(optimizer, ElasticRule) or not optimizer.ELASTIC_KINDS:
        raise ValueError(f"optimizer: {type(optimizer).__name__} declares no elastic rule (ELASTIC_KINDS, "
                         "thinwire.optim.elastic_rules.ElasticRule): give a thinwire optimizer")
    if not isinstance(states, (list, tuple)) or not states or not all(isinstance(s, dict) for s in states):
        raise ValueError("states must be a non-empty list of state_dicts, one per old rank")
    new = optimizer.comm.world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < new:
        raise ValueError(f"rank must be an integer in [0, {new}) (this optimizer's world size), got {rank!r}")


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
