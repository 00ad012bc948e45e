"""What a thinwire optimizer's `state_dict()` holds beyond torch's, and how a step in flight
survives a checkpoint.

    state_dict()       torch's state + the byte counters (STATS_KEY) + the steps taken
                       (STEP_KEY) + the step whose exchange is in flight, if any (INFLIGHT_KEY);
                       it changes nothing: the step stays in flight
    load_state_dict()  an exchange still in flight here is completed and dropped (`_drain`),
                       the state loaded, and a loaded step in flight kept for `_resume`, which
                       the next step() / flush() / start_step() / finish_step() calls: it sends
                       that step's message again (the exchange's `resume`), counted again:
                       the counters count what this process hands to torch.distributed, so a
                       resumed run's totals exceed an uninterrupted one's by that message
                       (nothing for ReduceAll, whose saved sum is not sent again)

The step in flight (`InFlight`) is saved as: the exchange's `checkpoint()` (the buffers its
start sent from, or ReduceAll's sum), the parameters this rank had no gradient for (their
values and state at the start), the hyperparameters it started with, the exact parameters
when a lookahead has moved them, and the algorithm's own encode-time values that its apply
needs (`_pending_state`). `CommunicatingOptimizer` (optim/base.py) inherits this; the step
machinery it drives lives there.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from .member import Member

STATS_KEY = "thinwire_comm_stats"
STEP_KEY = "thinwire_step"
INFLIGHT_KEY = "thinwire_in_flight"
ENVELOPE_KEYS = (STATS_KEY, STEP_KEY, INFLIGHT_KEY)


class InFlight(NamedTuple):
    """A step whose exchange has started and not yet landed."""
    step: int
    layout: list[Member]
    exchange: object            # a `thinwire.optim.exchange.Exchange`
    snapshot: dict              # key -> its views' values at the start, for parameters this rank had no gradient for
    hyper: list[dict]           # each param group's settings (lr, ...) when the step started


class EnvelopeCheckpoints:
    """The checkpoint half of the step envelope (module docstring); mixed into
    `CommunicatingOptimizer` before torch.optim.Optimizer."""

    def _pending_state(self, record: InFlight) -> dict:
        """Values `_encode` computed for the step in flight that its apply needs and that live
        neither in its message nor in self.state (default: none)."""
        return {}

    def _load_pending_state(self, record: InFlight, saved: dict) -> None:
        """Put back what `_pending_state` saved, for the re-sent step `record` (default: nothing)."""

    def _envelope_state(self) -> dict:
        state = {STATS_KEY: self.comm.stats.state_dict(), STEP_KEY: self._step}
        pending = self._pending if self._pending is not None else self._inflight_state()
        if pending is not None:
            state[INFLIGHT_KEY] = pending
        return state

    def _inflight_state(self) -> dict | None:
        """The step in flight, as `_resume` re-sends it (copies: the buffers are reused)."""
        record = self._inflight
        if record is None:
            return None
        absent = {i: [t.clone() for t in record.snapshot[m.key]]
                  for i, m in enumerate(record.layout) if m.key in record.snapshot}
        exact = [t.clone() for t in self._saved] if self._looked_ahead is not None else None
        return {"step": record.step, "message": record.exchange.checkpoint(),
                "absent": absent, "hyper": copy.deepcopy(record.hyper), "exact": exact,
                "algorithm": self._pending_state(record)}

    def _load_envelope_state(self, state_dict: dict) -> None:
        self._drain()
        if STATS_KEY in state_dict:
            self.comm.stats.load_state_dict(state_dict[STATS_KEY])
        self._step = int(state_dict.get(STEP_KEY, 0))
        self._agreed, self._carried, self._carried_flag = None, 0, None    # handshake again, with the loaded step
        self._pending = state_dict.get(INFLIGHT_KEY)

    def _drain(self) -> None:
        """Before a load: an exchange still in flight is completed (every peer is in that
        collective) and what it delivered is dropped; a lookahead is forgotten, not taken
        back (the model may already hold loaded values)."""
        record, self._inflight, self._looked_ahead = self._inflight, None, None
        self._verdicts.clear()                   # the verdicts of a run being replaced
        if record is not None:
            record.exchange.finish(record.step)

    def _resume(self) -> None:
        """A loaded step in flight is sent again, as it was sent before the checkpoint (and counted)."""
        saved, self._pending = self._pending, None
        if saved is None:
            return
        layout = self.layout()
        self._agree(self._describe(layout), f"step={self._step}")
        step = int(saved["step"])
        exchange = self._exchange(step, layout)
        snapshot = {layout[int(i)].key: [t.clone() for t in views] for i, views in saved["absent"].items()}
        record = InFlight(step, layout, exchange, snapshot, copy.deepcopy(saved["hyper"]))
        self._load_pending_state(record, saved["algorithm"])
        exchange.resume(saved["message"])        # counted: these bytes cross the wire again
        self._inflight = record
        if saved["exact"] is not None:           # the parameters hold the lookahead: the exact ones
            self._saved, self._looked_ahead = [t.clone() for t in saved["exact"]], layout

    def state_dict(self):
        """torch's state, the step count, the byte counters and the step in flight (kept in
        flight: calling this changes nothing)."""
        state = super().state_dict()
        state.update(self._envelope_state())
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        envelope = {k: state_dict.pop(k) for k in ENVELOPE_KEYS if k in state_dict}
        self._drain()
        super().load_state_dict(state_dict)
        keep_saved_dtypes(self, state_dict)
        self._load_envelope_state(envelope)


def keep_saved_dtypes(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """torch casts floating state to each parameter's dtype on load, which would round float32
    momenta beside bf16 parameters to bf16: take those tensors from the state_dict as saved."""
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for pid, p in zip(ids, params):
        for key, saved in state_dict["state"].get(pid, {}).items():
            now = opt.state[p].get(key)
            if torch.is_tensor(saved) and torch.is_tensor(now) and now.dtype != saved.dtype:
                opt.state[p][key] = saved.to(device=now.device, copy=True)
