"""Start N worker processes joined in one gloo process group on this machine.

    launch(worker_fn, workers=2, args=(...))      # worker_fn(rank, world_size, *args)

Rendezvous goes through a file in a fresh temporary directory, so concurrent runs never
collide on ports (and it works across network namespaces, which share the filesystem).
With `namespaces`, worker i first moves into network namespace namespaces[i] and gloo
talks over interface `ifname` there (see netns.EmulatedLink); `ifname` alone keeps gloo on
that interface here (a `--site` run's local world: "lo"). Under `torchrun`
(RANK/WORLD_SIZE set) use `init_from_env()` instead. Both set the process group's timeout:
a collective whose peer died or went silent fails within it (--peer-timeout).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import tempfile
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds a collective waits for a silent peer before every survivor raises (--peer-timeout);
# torch's own default is 30 minutes.
DEFAULT_PEER_TIMEOUT = 120.0

# Workers fork from a server process that imported these once, instead of each importing them
# again: ~3 s of CPU per worker (torch, thinwire, and torch._dynamo, which torch.optim imports
# when an optimizer is built), paid for every optimizer `thinwire compare` runs. The server is a
# fresh interpreter started by the launcher (never a fork of it) and starts no thread pool.
# Where forkserver does not exist (not POSIX), workers are spawned. The server is started once
# per launcher process, so workers see the environment the launcher had at its first launch().
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "thinwire", "thinwire.train.worker"]


def start_method() -> str:
    """'forkserver' (with PRELOAD imported in the server) where the platform has it, else 'spawn'."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    import multiprocessing.forkserver
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)    # read when the server first starts
    return "forkserver"


def _entry(rank: int, fn, world_size: int, rendezvous: str, threads: int, args: tuple,
           namespaces: list[str] | None, ifname: str | None, timeout: float, launcher: int) -> None:
    _die_with(launcher)
    if namespaces:
        from .netns import enter_namespace
        enter_namespace(namespaces[rank])          # before gloo opens any socket
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        fn(rank, world_size, *args)
    except Exception as err:
        if type(err).__name__ in ("PeerFailure", "ExchangeError"):   # a dead peer, a store that contradicts the
            # agreement (store.ExchangeError): one line per survivor
            print(f"thinwire: error: {err}", file=sys.stderr, flush=True)
            os._exit(1)                              # the group is broken: tearing it down could wait
        raise
    finally:
        dist.destroy_process_group()
    exit_process(0)


def exit_process(code: int) -> NoReturn:
    """End this worker now, skipping the interpreter's finalization.

    Python (before 3.14) ends a thread that asks for the GIL while the interpreter finalizes
    with pthread_exit. A gloo thread finishing a collective whose tensors Python no longer
    holds takes the GIL to free them; caught by pthread_exit it unwinds through a noexcept
    frame: 'terminate called without an active exception', SIGABRT, after a run that had
    succeeded (benchmarks/abort_stress.py --exit-race shows it). destroy_process_group()
    does not join those threads while anything holds the group (torch.optim's optimizers
    do), so not finalizing is the fix. Whatever the worker wrote is closed before this."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with(launcher: int) -> None:
    """Linux: this worker SIGKILLs itself when the launcher (pid `launcher`) dies, so killing
    `thinwire train` kills its workers and a second run never shares --out with orphans of the
    first. A forkserver's worker is the server's child, not the launcher's, and the server
    outlives the launcher while workers hold its pipe: so the worker watches the launcher's
    pidfd from a thread, on top of the parent-death signal."""
    _die_with_parent()
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:                       # it died before this worker got here
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):                # no pidfd (not Linux >= 5.3): the signal alone
        return
    import threading

    def watch() -> None:
        select.select([pidfd], [], [])               # readable once the launcher has exited
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="thinwire-launcher-watch", daemon=True).start()


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when the launcher dies (killing `thinwire train` kills
    its workers, so a second run never shares --out with orphans of the first)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def launch(fn, workers: int, args: tuple = (), namespaces: list[str] | None = None,
           ifname: str | None = None, timeout: float | None = None) -> None:
    """Run fn(rank, workers, *args) on `workers` new processes (`start_method`); re-raise any failure.
    `timeout`: seconds a collective waits for its peers (default DEFAULT_PEER_TIMEOUT)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if namespaces is not None and len(namespaces) != workers:
        raise ValueError(f"namespaces must name one namespace per worker ({workers}), got {len(namespaces)}")
    threads = max(1, (os.cpu_count() or 1) // workers)
    timeout = timeout or DEFAULT_PEER_TIMEOUT
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(fn, workers, os.path.join(tmp, "rendezvous"), threads, args,
                                               namespaces, ifname, timeout, os.getpid()), nprocs=workers, join=False,
                                 start_method=start_method())
        _wait_for_survivors(ctx.processes, timeout + SURVIVOR_GRACE_S)
        try:
            while not ctx.join():
                pass
        except mp.ProcessExitedException as err:       # no Python error from this worker: say how it ended
            codes = [p.exitcode for p in ctx.processes]
            dead = [r for r, c in enumerate(codes) if c is not None and c < 0] or [err.error_index]
            rank, code = dead[0], codes[dead[0]] if codes[dead[0]] is not None else err.exit_code
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise WorkerDied(f"worker {rank} of {workers} died ({how}); the other workers stopped (their errors, "
                             f"if any, are above)") from err


# Seconds beyond the peer timeout that survivors of a dead worker get to fail on their own.
SURVIVOR_GRACE_S = 10.0


def _wait_for_survivors(procs, grace: float) -> None:
    """Wait for every worker; once one has been killed (a signal), the others get `grace`
    seconds to fail on their own (their collectives raise PeerFailure, each printing its
    line) before ProcessContext.join stops them."""
    from multiprocessing.connection import wait
    deadline = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if deadline is None and failed:          # a Python error: stop the others now, as mp.spawn does
            deadline = time.monotonic() + (grace if any(c < 0 for c in failed) else 0.0)
        if not alive or (deadline is not None and time.monotonic() > deadline):
            return
        wait([p.sentinel for p in alive], timeout=0.5)


class WorkerDied(RuntimeError):
    """A worker process was killed or exited without a Python error."""


def init_from_env(timeout: float | None = None) -> tuple[int, int]:
    """Join the group torchrun describes (NCCL when CUDA is available, else gloo); a collective
    waits `timeout` seconds for its peers (default DEFAULT_PEER_TIMEOUT)."""
    # torchrun starts each worker in a session of its own: without this a worker whose agent
    # was killed trains on, holding the group its agent can no longer restart or leave.
    _die_with_parent()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    wait = timedelta(seconds=timeout or DEFAULT_PEER_TIMEOUT)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts and rendezvous rounds: a prefix
        # no earlier group used keeps a restarted worker from reading the dead group's gloo
        # addresses (TORCHELASTIC_RESTART_COUNT cannot be it: it differs between agents
        # once one has restarted, and does not change when a node joins).
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=wait)
        prefix = fresh_prefix(store, rank, world, wait.total_seconds())
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                                timeout=wait)
    else:
        dist.init_process_group(backend, timeout=wait)
    return dist.get_rank(), dist.get_world_size()


def fresh_prefix(store, rank: int, world: int, timeout: float) -> str:
    """A store key prefix that every rank of this group gets and no earlier group used.
    Rank 0 draws a new generation g; rank k > 0 asks for it under a token of its own (keys
    left by an earlier group's rank k are answered too, harmlessly) and confirms; rank 0
    answers until all world - 1 have confirmed g, which only this group's ranks can do."""
    if rank > 0:
        token = store.add("thinwire/tokens", 1)
        store.set(f"thinwire/ask/{rank}", str(token))
        g = int(store.get(f"thinwire/answer/{token}"))             # waits up to the store's timeout
        store.add(f"thinwire/gen_{g}/confirmed", 1)
        return f"thinwire/gen_{g}/"
    g, answered = store.add("thinwire/generation", 1), set()
    deadline = time.monotonic() + timeout
    while store.add(f"thinwire/gen_{g}/confirmed", 0) < world - 1:
        for k in range(1, world):
            if store.check([f"thinwire/ask/{k}"]):
                token = store.get(f"thinwire/ask/{k}").decode()
                if token not in answered:
                    store.set(f"thinwire/answer/{token}", str(g))
                    answered.add(token)
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 of {world}: not every rank joined generation {g} of the agent's store "
                               f"within {timeout:g} s")
        time.sleep(0.02)
    return f"thinwire/gen_{g}/"
