"""A step in flight (`overlap=True`) at an elastic resume (`thinwire.optim.elastic`): folded
back into the old rank's state, carried over rescaled, or refused; the rules and reasons are
in elastic.py's docstring."""

from __future__ import annotations

import torch

from ..compress import Payload
from .apmsqueeze import APMSqueeze
from .checkpoints import INFLIGHT_KEY
from .demo import DeMo
from .dense import DenseAllReduce
from .ef21_muon import EF21Muon
from .periodic import PeriodicAveraging
from .protocol import prefix_nbytes


def _layout_ids(optimizer) -> list[int]:
    """The state_dict ids (positions in param-group order) of the layout's parameters."""
    return [i for i, p in enumerate(optimizer.params) if p.requires_grad and p.numel()]


def fold_in_flight(optimizer, state: dict, i: int) -> dict:
    """Old rank i's state with its step in flight folded back (module docstring), or ValueError."""
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
    if isinstance(optimizer, PeriodicAveraging) or _sums(optimizer, record["step"]):
        return state                 # the sync not made: Δ_i stays in the replica; a sum: `rescaled_sum`
    if not isinstance(optimizer, (DeMo, EF21Muon)):
        raise ValueError(f"{refuse}: {type(optimizer).__name__}'s message has no local state to return to; "
                         "flush() before the checkpoint to resume it on another world size")
    layout, ids = optimizer.layout(), _layout_ids(optimizer)
    per_param = {pid: dict(s) for pid, s in state["state"].items()}
    if isinstance(optimizer, EF21Muon):              # M_j ← M_j⁺ where this rank had a gradient; G_j kept
        for k, (pid, m_new) in enumerate(zip(ids, record["algorithm"]["momenta"])):
            if k not in record["absent"]:
                per_param[pid]["momentum"] = m_new.clone()
    else:
        slots = optimizer._slots(layout)
        payload, scratch = record["message"][0][prefix_nbytes(len(layout)):], optimizer._scratch(slots)
        for (group, p, comp, offset, n, _), pid in zip(slots, ids):
            own = comp.read(Payload.from_buffer(payload[offset: offset + n], comp.payload_spec(p.shape)), p.shape)
            m = per_param[pid]["momentum"].clone()
            # M ← M + α T⁻¹(Q̂_i): what this rank sent returns to its momentum
            optimizer._subtract_sent(record["step"], group, p, comp, m, own, group["alpha"], scratch)
            per_param[pid]["momentum"] = m
    return {**state, "state": per_param}


def _sums(optimizer, step: int) -> bool:
    """Whether the exchange of `step` is a sum all-reduce (ReduceAll) that is not a sync."""
    return isinstance(optimizer, DenseAllReduce) or (isinstance(optimizer, APMSqueeze)
                                                     and step <= optimizer.warmup_steps)


def rescaled_sum(optimizer, states: list[dict], new: int) -> dict | None:
    """A summed step in flight, the same on every old rank, kept in flight for W' ranks."""
    records = [s.get(INFLIGHT_KEY) for s in states]
    if records[0] is None or not _sums(optimizer, records[0]["step"]):
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
