"""What every thinwire optimizer shares: a communicator, its stats, and their checkpointing."""

from __future__ import annotations

import torch

from ..comm import CommStats, Communicator

STATS_KEY = "thinwire_comm_stats"


class CommunicatingOptimizer(torch.optim.Optimizer):
    """A torch optimizer that talks to its peers through `self.comm`.

    `comm_stats` holds this rank's cumulative payload bytes, link bytes sent and received
    and collective count, and `comm_stats.last_step` the same four for the latest step.
    `state_dict()` carries the stats too, so a resumed run keeps counting where it stopped.
    """

    def _init_comm(self, process_group) -> None:
        self.comm = Communicator(process_group)

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
