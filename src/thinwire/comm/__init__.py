"""Collectives over torch.distributed with exact per-rank byte accounting."""

from .communicator import Communicator, Pending
from .collectives import DeltaCodec, OneBitAllReduce, compressed_allreduce, padded_numel
from .links import COLLECTIVES, link_bytes
from .stats import CommCounters, CommStats

__all__ = ["COLLECTIVES", "CommCounters", "CommStats", "Communicator", "DeltaCodec", "OneBitAllReduce", "Pending",
           "compressed_allreduce", "link_bytes", "padded_numel"]
