"""Snapshots in the store: what a site joining a run already going starts from.

Every `every` rounds a live site writes one signed object (the same envelope as a message,
so it is bound to the run's key and fingerprint, its round and its writer):

    snapshots/0000000040     torch.save({'round', 'model', 'optimizer'}), written once

'model' is the model's state_dict after round 40 was applied; 'optimizer' the optimizer's
state_dict with only what every replica holds alike. The state is split by the elastic rules'
kinds (`optim.elastic_rules`, each optimizer's `ELASTIC_KINDS`), as an elastic resume treats
a new rank: REPLICATED state (the step count, DiLoCo's and SparseLoCo's anchor θ₀ and outer
momentum) is copied; PER_RANK state (DeMo's momentum, SparseLoCo's error feedback e, an inner
optimizer's moments) starts from zero at the joiner: it is each site's own unsent residue,
and copying another site's would send that residue twice. Byte counters stay per site.

Every live site may publish: the parameters and the replicated state are identical on every
replica after each round, so whichever write wins (a conditional create) holds the same state.

    publish_snapshot(group, model, opt, every=20)        # after opt.step(), on each live site
    found = latest_snapshot(url, key, fingerprint)       # on the joiner: (round, state) or None
    round, state = found
    model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])
    group = StoreGroup(url, site, sites, key, fingerprint, first_round=round + 1)

The joiner's rounds after the snapshot's that already closed return at once from their
manifests (its message is late there and kept), so it reaches the others' round and is
taken again from the first round it publishes in time.
"""

from __future__ import annotations

import io
import logging

import torch

from ..optim.checkpoints import INFLIGHT_KEY, STATS_KEY
from ..optim.elastic_rules import PER_RANK, REPLICATED
from ..optim.shards import is_dtensor
from .envelope import FINGERPRINT_NBYTES, RejectedMessage, open_envelope, run_fingerprint
from .locations import Location
from .manifest import round_folder
from .urls import open_location

log = logging.getLogger(__name__)
FOLDER = "snapshots"


def snapshot_key(round: int) -> str:
    return f"{FOLDER}/{round_folder(round).split('/')[1]}"


def joiner_state(optimizer) -> dict:
    """`optimizer`'s state_dict as a joining site starts from: REPLICATED state kept, PER_RANK
    state zeroed, byte counters left out. ValueError when a step's exchange is in flight
    (its message belongs to this site: flush() first) or the optimizer declares no kinds."""
    kinds = getattr(optimizer, "ELASTIC_KINDS", None)
    if not kinds:
        raise ValueError(f"optimizer: {type(optimizer).__name__} declares no ELASTIC_KINDS, so what a joiner "
                         "may copy is unknown")
    state = optimizer.state_dict()
    if state.get(INFLIGHT_KEY) is not None:
        raise ValueError("optimizer: a step's exchange is in flight; flush() before publishing a snapshot")
    state.pop(STATS_KEY, None)
    if "state" in state:                                   # a torch-shaped state_dict (DeMo, SignDeMo)
        state["state"] = {pid: _replicated_only(s, kinds) for pid, s in state["state"].items()}
    elif "outer" in state:                                 # DiLoCo's family: outer by kind, inner per rank
        state["outer"] = [_replicated_only(s, kinds) for s in state["outer"]]
        state["inner"] = {**state["inner"], "state": {}}
    else:
        raise ValueError(f"optimizer: {type(optimizer).__name__}'s state_dict has neither 'state' nor 'outer'")
    return state


def _replicated_only(per_param: dict, kinds: dict) -> dict:
    """One parameter's state: REPLICATED values as they are, PER_RANK ones zero."""
    out = {}
    for key, value in per_param.items():
        kind = kinds.get(key, kinds.get("*"))
        if kind == REPLICATED:
            out[key] = value.clone() if torch.is_tensor(value) else value
        elif kind == PER_RANK:
            out[key] = torch.zeros_like(value) if torch.is_tensor(value) else type(value)(0)
        else:                                  # SERVER (kept where the server runs) or undeclared
            raise ValueError(f"optimizer: state key {key!r} is {kind or 'undeclared'}: no snapshot can carry it")
    return out


def publish_snapshot(group, model: torch.nn.Module, optimizer, every: int, extra: dict | None = None) -> int | None:
    """Write a snapshot of the newest round `group` took part in, when it is a multiple of
    `every` and not yet written by this site; the round written (or already there), else None.
    Call it between steps, with no exchange in flight (after step(), or flush() with overlap).
    `extra`: what else a joiner needs, saved beside the state as its 'extra' (the harness: its
    step and learning-rate schedule; tensors, numbers, strings, lists and dicts of them)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1 (rounds between snapshots), got {every!r}")
    round = group.next_round - 1
    if round < 1 or round % every or group.snapshot_round == round:
        return None
    state = {"round": round, "model": local_tensors(model.state_dict()),
             "optimizer": local_tensors(joiner_state(optimizer)), "extra": extra or {}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    rounds = group.rounds
    rounds.location.put_once(snapshot_key(round), rounds._seal(round, buffer.getvalue()))  # False: a peer's won
    group.snapshot_round = round
    return round


def local_tensors(value):
    """`value` (a state_dict: dicts, lists, tuples) with every FSDP2 DTensor replaced by this
    rank's shard of it: what a snapshot holds, one object per shard, loadable with
    `weights_only=True` and into the same shard of a site sharded alike (`load_local`)."""
    if is_dtensor(value):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_tensors(v) for v in value)
    return value


def load_local(model: torch.nn.Module, saved: dict) -> None:
    """Copy a snapshot's 'model' into `model` in place: each tensor of its state_dict (an FSDP2
    DTensor: this rank's shard) from the saved tensor of the same name and shape. KeyError or
    ValueError naming the tensor when the snapshot is another model's or another sharding's."""
    mine = model.state_dict()
    if set(mine) != set(saved):
        raise KeyError(f"the snapshot's tensors are not this model's: missing {sorted(set(mine) - set(saved))[:3]}, "
                       f"unexpected {sorted(set(saved) - set(mine))[:3]}")
    with torch.no_grad():
        for name, tensor in mine.items():
            local = tensor.to_local() if is_dtensor(tensor) else tensor
            if local.shape != saved[name].shape:
                raise ValueError(f"snapshot: {name} is {list(saved[name].shape)} there, {list(local.shape)} here "
                                 "(another sharding of the site?)")
            local.copy_(saved[name])


def latest_snapshot(location: str | Location, key: str | bytes, fingerprint: str | bytes, *,
                    options: dict | None = None, at_most: int | None = None) -> tuple[int, dict] | None:
    """(round, state) of the newest snapshot in `location` that verifies as this run's (key,
    fingerprint as `RoundExchange` takes them), None when there is none; with `at_most`, the
    newest of a round <= at_most (the ranks of a sharded site agree on one round). A snapshot
    that does not verify is logged and passed over for the one before it."""
    if not isinstance(location, Location):
        location = open_location(location, **(options or {}))
    raw = isinstance(fingerprint, bytes) and len(fingerprint) == FINGERPRINT_NBYTES
    fingerprint = fingerprint if raw else run_fingerprint(fingerprint)
    for name in sorted(location.list(FOLDER), reverse=True):
        round = int(name.rsplit("/", 1)[1])
        if at_most is not None and round > at_most:
            continue
        blob = location.get(name)
        try:
            message = open_envelope(blob or b"", key=key, fingerprint=fingerprint, round=round)
        except RejectedMessage as err:
            log.warning("snapshot of round %d rejected (%s); trying an older one", round, err)
            continue
        return round, torch.load(io.BytesIO(message.payload), weights_only=True)
    return None
