"""DiLoCo: H local steps of any optimizer, then an outer Nesterov step on the averaged
pseudo-gradient (Douillard et al., arXiv 2311.08105; torchft `DiLoCo`, OpenDiLoCo).

On every rank, with θ₀ the parameters all ranks agreed on at the last sync (the anchor):

    θ ← inner.step(θ)                               every step: local gradients, no communication
    Δ̄ = mean_ranks (θ − θ₀)                        every H-th step, after its local step: one
                                                    collective of one flat buffer
    g = −Δ̄                                          the pseudo-gradient, mean_ranks (θ₀ − θ)
    b ← μ b + g                                     outer momentum (torch SGD, dampening 0)
    θ₀ ← θ₀ − η_out (g + μ b)                       Nesterov; defaults η_out = 0.7, μ = 0.9
    θ ← θ₀                                          every rank leaves the sync bit-identical

DiLoCo is the composition of two parts: `LocalSteps` (`thinwire.optim.local_steps`: the
inner torch optimizer, whose groups are this object's, so LR schedulers act on the inner
learning rate) and the sync rule `DenseMean` (`thinwire.optim.dense_mean`: the equations above
from Δ̄ on, and the wire formats), which LoRDO shares; what non-finite gradients do, and overlap
(streaming DiLoCo's delayed outer step) are in `thinwire.optim.periodic`. Between syncs
replicas differ by design; right after each sync they are bit-identical.

Two tiers (FSDP2 shards, `process_group` = the group across sites): the inner torch optimizer
steps the DTensor parameters as it would under FSDP2 alone; Δ, θ₀, the outer step and the
sync run on this rank's shard, exchanged with the ranks holding it in the other sites.
"""

from __future__ import annotations

from .dense_mean import DenseMean
from .local_steps import LocalSteps
from .periodic import check_delay, check_sync_every, of_sync


class DiLoCo(LocalSteps):
    """DiLoCo over any inner optimizer; see the module docstring for the equations.

    Args:
        inner: callable params -> torch.optim.Optimizer (default: torch.optim.AdamW with its
            defaults, lr 1e-3); it receives `params` as given (tensors or groups).
        sync_every: H, local steps between syncs (default 32; papers use 20-500).
        outer_lr, outer_momentum: Nesterov outer SGD (defaults 0.7 and 0.9, as published).
        wire: 'fp32' (default) | 'bf16' | 'int8' for the pseudo-gradient, with error feedback.
            'bf16' and 'int8' may go through the store (`process_group=StoreGroup(...)`).
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite; see
            `thinwire.optim.periodic`. With a fused inner optimizer (`inner=lambda p:
            torch.optim.AdamW(p, fused=True)`) a bad local step is skipped on the device
            (`found_inf`) and no local step reads the host; with 'skip' the fp32 sync (delay 1)
            reads nothing either (`thinwire.optim.verdict`).
        overlap: True leaves each sync's exchange in flight until the next step() (the
            delayed outer step of `thinwire.optim.periodic`).
        delay: with overlap, the steps a sync stays in flight (default 1; at most sync_every):
            it lands at the start of that many steps later, and each replica keeps the local
            steps it made meanwhile (`thinwire.optim.periodic`).
    Initial parameters must be identical on all ranks (as with DDP's broadcast).
    """

    kind = "diloco"
    outer_lr, outer_momentum, wire, codec = (of_sync(name) for name in ("outer_lr", "outer_momentum", "wire", "codec"))

    def __init__(self, params, inner=None, sync_every: int = 32, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, wire: str = "fp32", nonfinite: str = "raise", process_group=None,
                 overlap: bool = False, delay: int = 1):
        check_sync_every(sync_every)
        sync = DenseMean(outer_lr, outer_momentum, wire)              # checks outer_lr, outer_momentum, wire
        check_delay(delay, sync_every, overlap)
        self._init_local_steps(params, inner, process_group, nonfinite, sync_every, sync, overlap, delay)
