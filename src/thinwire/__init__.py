"""thinwire: data-parallel training over slow links with compressed optimizer messages.

    from thinwire import DeMo
    opt = DeMo(model.parameters(), lr=3e-4, topk=32)      # inside torch.distributed workers
    loss.backward(); opt.step(); opt.zero_grad()          # no DDP gradient all-reduce
    print(opt.comm_stats.last_step.payload_bytes)
"""

from .comm import CommCounters, CommStats, Communicator
from .optim import (APMSqueeze, DeMo, DenseAllReduce, DiLoCo, EF21Muon, LoRDO, NonFiniteGradientError,
                    PeerMismatchError, SignDeMo, SparseLoCo)

__version__ = "0.1.0"
__all__ = ["APMSqueeze", "CommCounters", "CommStats", "Communicator", "DeMo", "DenseAllReduce", "DiLoCo", "EF21Muon",
           "LoRDO", "NonFiniteGradientError", "PeerMismatchError", "SignDeMo", "SparseLoCo", "__version__"]
