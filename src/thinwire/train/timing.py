"""Time blocked in collectives, per process: `BLOCKED[0]` seconds since the loop reset it.

The training loop needs compute time apart from communication (modelled time adds its own
transfer time to compute). `install()` points thinwire's Communicator at a torch.distributed
proxy that adds the time of every collective call and of every `wait()` on its work to
BLOCKED; the PowerSGD counter (powersgd.py) adds its waits too.
"""

from __future__ import annotations

import time

import torch.distributed as dist

BLOCKED = [0.0]
COLLECTIVES = {"all_reduce", "all_gather_single", "all_gather_into_tensor", "all_to_all_single", "gather",
               "broadcast"}


class TimedWork:
    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            BLOCKED[0] += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._work, name)


class TimedDist:
    """torch.distributed, with collective calls and their waits added to BLOCKED."""

    def __getattr__(self, name):
        fn = getattr(dist, name)
        if name not in COLLECTIVES:
            return fn

        def timed(*args, **kwargs):
            t = time.perf_counter()
            work = fn(*args, **kwargs)
            BLOCKED[0] += time.perf_counter() - t
            return TimedWork(work) if work is not None else None
        return timed


def install() -> None:
    import thinwire.comm.communicator as communicator
    communicator.dist = TimedDist()
