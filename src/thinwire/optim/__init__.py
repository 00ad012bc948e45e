"""Optimizers that communicate: DeMo and the dense all-reduce baseline."""

from .base import CommunicatingOptimizer
from .demo import DeMo
from .dense import DenseAllReduce
from .protocol import NonFiniteGradientError, PeerMismatchError

__all__ = ["CommunicatingOptimizer", "DeMo", "DenseAllReduce", "NonFiniteGradientError", "PeerMismatchError"]
