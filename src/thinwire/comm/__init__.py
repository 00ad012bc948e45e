"""Collectives over torch.distributed with exact per-rank byte accounting."""

from .communicator import Communicator, Pending
from .links import COLLECTIVES, link_bytes
from .stats import CommCounters, CommStats

__all__ = ["COLLECTIVES", "CommCounters", "CommStats", "Communicator", "Pending", "link_bytes"]
