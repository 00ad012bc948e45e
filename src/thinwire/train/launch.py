"""Start N worker processes joined in one gloo process group on this machine.

    launch(worker_fn, workers=2, args=(...))      # worker_fn(rank, world_size, *args)

Rendezvous goes through a file in a fresh temporary directory, so concurrent runs never
collide on ports (and it works across network namespaces, which share the filesystem).
With `namespaces`, worker i first moves into network namespace namespaces[i] and gloo
talks over interface `ifname` there (see netns.EmulatedLink). Under `torchrun`
(RANK/WORLD_SIZE set) use `init_from_env()` instead. Both set the process group's timeout:
a collective whose peer died or went silent fails within it (--peer-timeout).
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds a collective waits for a silent peer before every survivor raises (--peer-timeout);
# torch's own default is 30 minutes.
DEFAULT_PEER_TIMEOUT = 120.0


def _entry(rank: int, fn, world_size: int, rendezvous: str, threads: int, args: tuple,
           namespaces: list[str] | None, ifname: str | None, timeout: float = DEFAULT_PEER_TIMEOUT) -> None:
    if namespaces:
        from .netns import enter_namespace
        enter_namespace(namespaces[rank])          # before gloo opens any socket
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def launch(fn, workers: int, args: tuple = (), namespaces: list[str] | None = None,
           ifname: str | None = None, timeout: float | None = None) -> None:
    """Run fn(rank, workers, *args) on `workers` spawned processes; re-raise any failure.
    `timeout`: seconds a collective waits for its peers (default DEFAULT_PEER_TIMEOUT)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if namespaces is not None and len(namespaces) != workers:
        raise ValueError(f"namespaces must name one namespace per worker ({workers}), got {len(namespaces)}")
    threads = max(1, (os.cpu_count() or 1) // workers)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_entry, args=(fn, workers, os.path.join(tmp, "rendezvous"), threads, args, namespaces, ifname,
                                   timeout or DEFAULT_PEER_TIMEOUT), nprocs=workers)
        except mp.ProcessExitedException as err:       # killed (no traceback): say which and how
            how = f"signal {err.signal_name}" if getattr(err, "signal_name", None) else f"exit code {err.exit_code}"
            raise WorkerDied(f"worker {err.error_index} of {workers} died ({how}); the others were stopped") from err


class WorkerDied(RuntimeError):
    """A worker process was killed or exited without a Python error."""


def init_from_env(timeout: float | None = None) -> tuple[int, int]:
    """Join the group torchrun describes (NCCL when CUDA is available, else gloo); a collective
    waits `timeout` seconds for its peers (default DEFAULT_PEER_TIMEOUT)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    wait = timedelta(seconds=timeout or DEFAULT_PEER_TIMEOUT)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts: without a prefix per attempt a
        # restarted worker can read the dead group's gloo addresses and fail to connect.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=wait)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"thinwire/attempt_{attempt}/", store), rank=rank,
                                world_size=world, timeout=wait)
    else:
        dist.init_process_group(backend, timeout=wait)
    return dist.get_rank(), dist.get_world_size()
