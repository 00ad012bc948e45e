"""What every thinwire optimizer shares: a communicator, its stats, and their checkpointing."""

from __future__ import annotations

import torch

from ..comm import CommStats, Communicator
from .protocol import handshake

STATS_KEY = "thinwire_comm_stats"


def flatten_grads(params, buffer: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Every parameter's gradient (zeros where it is None), in order, in one flat `dtype`
    buffer: `buffer` itself when its size and dtype fit, so steps reuse one allocation."""
    total = sum(p.numel() for p in params)
    if buffer is None or buffer.numel() != total or buffer.dtype != dtype:
        buffer = torch.empty(total, dtype=dtype, device=params[0].device)
    offset = 0
    for p in params:
        view = buffer[offset: offset + p.numel()]
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.reshape(-1))
        offset += p.numel()
    return buffer


class CommunicatingOptimizer(torch.optim.Optimizer):
    """A torch optimizer that talks to its peers through `self.comm`.

    `comm_stats` holds this rank's cumulative payload bytes, link bytes sent and received
    and collective count, and `comm_stats.last_step` the same four for the latest step.
    `state_dict()` carries the stats too, so a resumed run keeps counting where it stopped.
    """

    def _init_comm(self, process_group) -> None:
        self.comm = Communicator(process_group)
        self._agreed: str | None = None          # the description all ranks last agreed on

    @property
    def params(self) -> list[torch.Tensor]:
        """Every parameter in param-group order: the order of every flat buffer."""
        return [p for g in self.param_groups for p in g["params"]]

    def _begin_step(self, closure) -> object:
        """Run `closure` with gradients on (its loss is returned) and open this step's counters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm.stats.begin_step()
        return loss

    def _agree(self, description: str, extra: str = "") -> None:
        """Handshake with every peer whenever `description` (layout, wire settings) changes:
        a mismatch raises PeerMismatchError on every rank before any payload is sent.
        `extra` travels in the handshake but is not remembered (e.g. the step after a load)."""
        if description != self._agreed:
            handshake(self.comm, f"{description} {extra}".rstrip())
            self._agreed = description

    @property
    def comm_stats(self) -> CommStats:
        return self.comm.stats

    def state_dict(self):
        state = super().state_dict()
        state[STATS_KEY] = self.comm.stats.state_dict()
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        stats = state_dict.pop(STATS_KEY, None)
        super().load_state_dict(state_dict)
        if stats is not None:
            self.comm.stats.load_state_dict(stats)
