"""A step in flight (`overlap=True`) at an elastic resume (`thinwire.optim.elastic`): folded
back into the old rank's state (each optimizer's `_elastic_fold`), carried over rescaled (a
sum: `_elastic_sums`), or refused; the rules and reasons are in elastic.py's docstring."""

from __future__ import annotations

import torch

from .checkpoints import INFLIGHT_KEY
from .elastic_rules import ElasticRule


def fold_in_flight(optimizer: ElasticRule, state: dict, i: int) -> dict:
    """Old rank i's state with its step in flight folded back by the optimizer's rule
    (`ElasticRule._elastic_fold`), kept as a sum (`rescaled_sum`), or ValueError."""
    if INFLIGHT_KEY not in state:
        return state
    state = dict(state)
    record = state.pop(INFLIGHT_KEY)
    refuse = f"states[{i}] has step {record['step']} in flight (overlap=True)"
    if record["exact"] is not None:
        raise ValueError(f"{refuse} under a lookahead: the model holds moved parameters; flush() before the "
                         "checkpoint to resume it on another world size")
    if {"before_jump", "eager_jump"} & set(record["algorithm"]):
        raise ValueError(f"{refuse} after an eager jump (SparseLoCo, delay > 1): the replica holds its own estimate "
                         "of the sync's result; flush() before the checkpoint to resume it on another world size")
    if optimizer._elastic_sums(record["step"]):
        return state                 # a sum: `rescaled_sum` carries it
    return optimizer._elastic_fold(state, record, refuse)


def rescaled_sum(optimizer, states: list[dict], new: int) -> dict | None:
    """A summed step in flight, the same on every old rank, kept in flight for W' ranks."""
    records = [s.get(INFLIGHT_KEY) for s in states]
    if records[0] is None or not optimizer._elastic_sums(records[0]["step"]):
        return None
    if any(r is None for r in records):
        raise ValueError(f"old ranks {[i for i, r in enumerate(records) if r is None]} have no step in flight, "
                         "rank 0 has one: were these state_dicts saved at one step?")
    for i, r in enumerate(records[1:], 1):
        if r["step"] != records[0]["step"] or not torch.equal(r["message"][0], records[0]["message"][0]):
            raise ValueError(f"the step in flight differs between old rank 0 and old rank {i}, but an all-reduced "
                             "sum is the same on every rank: were these state_dicts saved at one step?")
    absent = {k: v for k, v in records[0]["absent"].items()          # no gradient on any rank: the same snapshot
              if all(k in r["absent"] for r in records)}
    total = records[0]["message"][0]
    # Σ' = Σ · W'/W: the same mean Σ'/W' = Σ/W, and every rank counted in the trailer W'/W times
    scaled = (total.double() * new / len(states)).to(total.dtype)
    return {**records[0], "message": [scaled], "absent": absent, "exact": None}
