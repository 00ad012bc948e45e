"""What a periodic optimizer's sync does (`SyncRule`), each hook with its default: the object
`PeriodicAveraging` (`thinwire.optim.periodic`) composes and calls at a sync step, so that
DiLoCo, SparseLoCo and LoRDO differ in their rule and their local step, not in the envelope.

A rule owns its settings and the state it keeps between its hooks (the message, what its
apply commits); the per-parameter state lives in the optimizer's self.state[p] beside the
anchor θ₀. Each hook gets the optimizer as `host`: its `state`, `delay`, `comm`, and the
delayed landing's θ_s (`host._launch`, `host._launched`, `host._rejoin_all`, `host._rejoin`).
The hooks are the envelope's (`thinwire.optim.hooks`) at a sync step:

    connect(comm)                       build the exchange, once the communicator exists
    describe(delay)                     the settings every rank must share, after K=
    exchange(layout)                    the sync's exchange, sized
    prepare(host, layout)               lazy per-parameter state, after θ₀
    check(host, layout)                 ValueError before the sync's local step moves anything
    encode(host, step, layout, exch.)   after the local step: the message, what apply commits
    arrival / apply / discard / keep_own / pending / load_pending / applies_masked / apply_masked
"""

from __future__ import annotations

import torch

from .member import Member


class SyncRule:
    """A periodic sync (module docstring); `encode`, `exchange`, `apply` and `describe` are
    what a rule must write."""

    STORE_EXCHANGE = False
    """True when the sync is one GatherAll and `keep_own` holds a message that missed a store
    round (`thinwire.optim.hooks.AlgorithmHooks.STORE_EXCHANGE`)."""

    def connect(self, comm) -> None:
        raise NotImplementedError

    def describe(self, delay: int) -> str:
        raise NotImplementedError

    def exchange(self, layout: list[Member]):
        raise NotImplementedError

    def prepare(self, host, layout: list[Member]) -> None:
        """Per-parameter state beside θ₀ (default: none)."""

    def check(self, host, layout: list[Member]) -> None:
        """ValueError when the sync cannot be made on `layout` (default: it can)."""

    def encode(self, host, step: int, layout: list[Member], exchange) -> None:
        raise NotImplementedError

    def arrival(self, host, step: int, layout: list[Member], delivery) -> list[torch.Tensor]:
        """Device flags of malformed rows (default: none), read with the prefixes."""
        return []

    def apply(self, host, step: int, layout: list[Member], delivery, skip: torch.Tensor | None) -> None:
        raise NotImplementedError

    def applies_masked(self, host) -> bool:
        """True when `apply_masked` lands a sync under a device flag (default False)."""
        return False

    def apply_masked(self, host, step: int, layout: list[Member], delivery, skip: torch.Tensor) -> None:
        raise NotImplementedError

    def discard(self, host, step: int, layout: list[Member], exchange) -> None:
        """A sync made on no rank: undo what `encode` moved (default: nothing)."""

    def keep_own(self, host, step: int, layout: list[Member], exchange) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot keep a message that missed a round")

    def pending(self) -> dict:
        """What a sync in flight needs at its landing beyond the message and self.state (default: none)."""
        return {}

    def load_pending(self, host, record, saved: dict) -> None:
        """Put back what `pending` saved (default: nothing)."""
