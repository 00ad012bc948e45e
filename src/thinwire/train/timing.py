"""Time blocked in collectives, per process: `BLOCKED[0]` seconds since the loop reset it.

The training loop needs compute time apart from communication (modelled time adds its own
transfer time to compute). `install()` sets `add_blocked` as thinwire's Communicator
blocked-time observer (`Communicator.set_blocked_observer`), so the time of every
collective call and of every wait on an async one is added to BLOCKED; the store
exchange's rounds (`thinwire.store.communicator`, `--exchange`) report to the same observer
as all_gathers; the PowerSGD counter (powersgd.py), whose collectives bypass the
Communicator, adds its waits too.
"""

from __future__ import annotations

from ..comm import Communicator

BLOCKED = [0.0]


def add_blocked(op: str, seconds: float) -> None:
    """The observer: adds `seconds` blocked in collective `op` to BLOCKED."""
    BLOCKED[0] += seconds


def install() -> None:
    """Time what every Communicator in this process blocks on (idempotent)."""
    Communicator.set_blocked_observer(add_blocked)
