"""Byte and call counters a communicator keeps for its rank."""

from __future__ import annotations

from dataclasses import dataclass, field

COUNTER_FIELDS = ("payload_bytes", "link_bytes_sent", "link_bytes_received", "collectives")


@dataclass
class CommCounters:
    """Integer counters for one rank.

    payload_bytes: size of the messages this rank produced (what papers quote as "MB/step").
    link_bytes_sent / link_bytes_received: what the rank's link carries under the standard
        algorithm of each collective (`thinwire.comm.links`).
    collectives: number of collective calls.
    """

    payload_bytes: int = 0
    link_bytes_sent: int = 0
    link_bytes_received: int = 0
    collectives: int = 0

    def add(self, payload: int, sent: int, received: int) -> None:
        self.payload_bytes += payload
        self.link_bytes_sent += sent
        self.link_bytes_received += received
        self.collectives += 1

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTER_FIELDS}


@dataclass
class CommStats(CommCounters):
    """Cumulative counters, plus `last_step` (since the last `begin_step`) and `by_tag`.

    `by_tag` splits the cumulative figures by the tag each collective was issued with
    (e.g. 'payload', 'handshake'), so control traffic is counted but identifiable.
    """

    steps: int = 0
    last_step: CommCounters = field(default_factory=CommCounters)
    by_tag: dict[str, CommCounters] = field(default_factory=dict)

    def begin_step(self) -> None:
        self.steps += 1
        self.last_step = CommCounters()

    def record(self, tag: str, payload: int, sent: int, received: int) -> None:
        self.add(payload, sent, received)
        self.last_step.add(payload, sent, received)
        self.by_tag.setdefault(tag, CommCounters()).add(payload, sent, received)

    def state_dict(self) -> dict:
        return {
            "totals": self.as_dict(),
            "steps": self.steps,
            "last_step": self.last_step.as_dict(),
            "by_tag": {k: v.as_dict() for k, v in self.by_tag.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        for key, value in state["totals"].items():
            setattr(self, key, int(value))
        self.steps = int(state["steps"])
        self.last_step = CommCounters(**state["last_step"])
        self.by_tag = {k: CommCounters(**v) for k, v in state["by_tag"].items()}
