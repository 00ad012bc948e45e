"""PyTorch's own PowerSGD DDP communication hook, with its bytes counted exactly as sent.

`powerSGD_hook` (and the vanilla all-reduce it runs before `start_powerSGD_iter`) call
`dist.all_reduce` through their modules' `dist` name, partly from future callbacks on
other threads. `count_ddp_hook_collectives` points that name at a thin proxy that records
each all-reduced tensor's real `nbytes` in a CommStats (with the same link formulas as
thinwire's Communicator) and forwards the call, so the count is what the hook hands to
torch.distributed, nothing modelled. It is installed once per worker process.

The proxy also waits for each all-reduce before returning it. PowerSGD issues its Q
all-reduce from a callback of the P all-reduce's future; with several DDP buckets on gloo
those callbacks run on other threads, so ranks can issue one bucket's Q and another
bucket's P in different orders and gloo aborts ("collective mismatch"). A completed future
runs its callbacks inline, so waiting makes every rank issue the same sequence. The cost is
no overlap of communication with backward, which thinwire's optimizers do not get either;
the wait is timed into timing.BLOCKED, so PowerSGD's compute and comm time separate too.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ..comm import CommStats, link_bytes
from .timing import BLOCKED


class _CountingDist:
    """Forwards every attribute to torch.distributed; `all_reduce` is recorded first."""

    def __init__(self, stats: CommStats):
        self._stats, self._lock = stats, threading.Lock()

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, group=None, **kwargs):
        world = dist.get_world_size(group)
        sent, received = link_bytes("all_reduce", tensor.nbytes, world)
        with self._lock:                                   # callbacks run on gloo threads
            self._stats.record("powersgd", tensor.nbytes, sent, received)
        t = time.perf_counter()
        work = dist.all_reduce(tensor, *args, group=group, **kwargs)
        if work is not None:
            work.wait()
        BLOCKED[0] += time.perf_counter() - t
        return work


def count_ddp_hook_collectives(stats: CommStats) -> None:
    proxy = _CountingDist(stats)
    powerSGD_hook.dist = proxy
    default_hooks.dist = proxy


def ddp_powersgd(model, rank: int = 4, start_iter: int = 2) -> tuple[DistributedDataParallel, CommStats]:
    """DDP(model) with the PowerSGD hook at `rank`, error feedback and warm start on.

    start_iter=2 (the smallest PyTorch allows with error feedback): one dense step, then
    compressed; PyTorch's default of 1000 would make short runs all dense.
    """
    stats = CommStats()
    count_ddp_hook_collectives(stats)
    ddp = DistributedDataParallel(model)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=start_iter)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, stats
