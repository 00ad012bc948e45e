"""What an algorithm supplies to the step envelope (`thinwire.optim.base`), each hook with its
default: four it must write (`_describe`, `_exchange`, `_encode`, `_apply`), the rest when
it needs them. `CommunicatingOptimizer` inherits this; an algorithm overrides what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .member import Member

if TYPE_CHECKING:
    from .checkpoints import InFlight


class AlgorithmHooks:
    """The algorithm's side of the envelope; the step order is in `thinwire.optim.base`."""

    EARLY_START = False
    """True when `_encode` never reads the parameters nor `_apply` the state, and `_exchange`
    alternates two exchanges by step parity: overlap then sends step t before applying t − 1."""

    REPLICAS_DRIFT = False
    """True when replicas differ between exchanges (local steps between syncs): a checkpoint
    then keeps every rank's own parameters beside the one replica (train/checkpoint.py)."""

    def _describe(self, layout: list[Member]) -> str:
        raise NotImplementedError

    def _exchange(self, step: int, layout: list[Member]):
        raise NotImplementedError

    def _prepare(self, step: int, layout: list[Member]) -> None:
        """Create lazily initialised state before this step (default: nothing)."""

    def _encode(self, step: int, layout: list[Member], exchange) -> None:
        raise NotImplementedError

    def _apply(self, step: int, layout: list[Member], delivery) -> None:
        raise NotImplementedError

    STORE_EXCHANGE = False
    """True when every exchange is one all_gather (`GatherAll`) and `_keep_own` can hold a
    message that missed a store round: the store exchange (`thinwire.store.StoreGroup`) is
    refused otherwise."""

    def _keep_own(self, step: int, layout: list[Member], exchange) -> None:
        """This rank's message missed the store round that every site applies without it:
        fold it back into local state so it is sent later (called before `_apply`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot keep a message that missed a round")

    def _discard(self, step: int, layout: list[Member], exchange) -> None:
        """A flagged step is dropped on every rank: undo what `_encode` took out of local state
        for the message (default: nothing)."""

    def _estimate(self, step: int, layout: list[Member], exchange) -> None:
        """lookahead: move the parameters by this rank's local estimate of the update its
        exchange in flight will deliver (they are put back exactly before it lands)."""
        raise NotImplementedError(f"{type(self).__name__} has no lookahead estimate")

    def _landing_step(self, record: InFlight) -> int:
        """overlap: the step whose step() call lands `record`'s exchange, before its own update
        (default: the next one). A later one leaves the exchange in flight across local steps
        (no exchange of their own) until then (`PeriodicAveraging`'s delay)."""
        return record.step + 1

    def _local_views(self, p: torch.Tensor) -> list[torch.Tensor]:
        """State of p kept outside self.state[p] that its step may change (default: none)."""
        return []

    def _masks_nonfinite(self, layout: list[Member]) -> bool:
        """True when `_encode` may run on non-finite gradients: it reads
        `self.gradients_nonfinite` (a 0-dim bool on the device) and leaves what it keeps finite
        (e.g. takes them as zeros, as for a parameter without a gradient; a local step skips
        its update on the device), so the envelope need not read the gradients' finiteness on
        the host before the message; the flag travels in the message (a local step's in the
        next one) and every rank reads it once, after the exchange.
        Default False: the envelope reads it first and skips the encode of a bad rank."""
        return False

    def _applies_masked(self, layout: list[Member]) -> bool:
        """True when `_apply_masked` can land a step under a device flag (nonfinite='skip' then
        reads nothing on the host: `thinwire.optim.verdict`). Default False."""
        return False

    def _apply_masked(self, step: int, layout: list[Member], delivery, skip: torch.Tensor) -> None:
        """`_apply` where `skip` (a 0-dim bool on the device) is False; where it is True,
        exactly what a flagged step does (`_discard`, and nothing else moves)."""
        raise NotImplementedError

    def _arrival(self, step: int, layout: list[Member], delivery) -> list[torch.Tensor]:
        """Device flags (0-dim bool, True: malformed) of what arrived, checked before the
        step's one host read, which reads them with the prefixes (default: none). A flag
        that is set makes every rank raise ValueError, after the non-finite check."""
        return []

    def _presence(self, layout: list[Member]) -> list[bool]:
        """Which layout parameters this rank has something to send for: a gradient."""
        return [m.param.grad is not None for m in layout]
