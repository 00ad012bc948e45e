"""Optimizers that communicate: DeMo (and SignDeMo, its 1-bit variant), APMSqueeze, EF21-Muon, LoRDO, DiLoCo,
SparseLoCo and the dense all-reduce baseline."""

from .apmsqueeze import APMSqueeze
from .base import CommunicatingOptimizer
from .demo import DeMo
from .dense import DenseAllReduce
from .diloco import DiLoCo
from .ef21_muon import EF21Muon
from .lordo import LoRDO
from .protocol import NonFiniteGradientError, PeerMismatchError
from .sign_demo import SignDeMo
from .sparseloco import SparseLoCo

__all__ = ["APMSqueeze", "CommunicatingOptimizer", "DeMo", "DenseAllReduce", "DiLoCo", "EF21Muon", "LoRDO",
           "NonFiniteGradientError", "PeerMismatchError", "SignDeMo", "SparseLoCo"]
