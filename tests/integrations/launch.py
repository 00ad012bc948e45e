"""What the framework tests share: start an example under torchrun with 2 gloo processes,
wait for it, read the collectives it counted, compare saved states."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import torch

from tests.train.shared import Forked, start

WORKER = Path(__file__).resolve().parent / "worker.py"


def torchrun(example: Path, *args: str, env: dict) -> Forked:
    """`torchrun --standalone --nproc-per-node 2 example *args`, output captured. The agent is
    forked from the tests' server (tests.train.shared.start: torch already imported, ~3 s of
    CPU fewer a launch); it starts each worker as torchrun does, a new interpreter. With an
    `env` from `preloaded`, that interpreter is worker.py's, which has the example run by a
    process forked from the module's preloaded server (the example's libraries imported once
    for all the module's launches, not once a worker: ~5 s of CPU fewer a worker)."""
    target = [str(WORKER), str(example)] if PRELOADED in env else [str(example)]
    return start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  *target, *args], env=env)


PRELOADED = "THINWIRE_TEST_PRELOADED"


@contextlib.contextmanager
def preloaded(example: Path, env: dict):
    """A server that imported what `example` imports, in `env`, once (its top level run under
    another name than __main__: Lightning's, transformers' or Accelerate's import is ~5 s of
    CPU, paid by every worker of every launch otherwise), and forks a process for each worker
    that worker.py starts: the example as `python -u example args` runs it, as __main__ in
    that worker's environment, directory and standard streams. Yields `env` naming it:
    torchrun(..., env=that) launches through it. The server ends with the context."""
    from tests.dist import _context
    directory = tempfile.mkdtemp(prefix="preloaded-")
    path = os.path.join(directory, "socket")
    server = _context().Process(target=_serve, args=(path, str(example), env), daemon=True)
    server.start()
    try:
        yield {**env, PRELOADED: path}
    finally:
        server.kill()
        server.join()
        shutil.rmtree(directory, ignore_errors=True)


def _serve(path: str, example: str, env: dict) -> None:
    """The preloaded server: forked from the tests' server (torch, thinwire imported), the
    example's imports added; a worker forked for each connection, its exit code sent back when
    it ends (worker.py ends with it)."""
    torch.set_num_threads(1)              # no intra-op threads before a fork (OMP_NUM_THREADS=1 in the workers)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, os.path.dirname(example))
    with _captured() as printed:
        runpy.run_path(example, run_name="preloaded")    # the imports; main() is not run
    sys.path.pop(0)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # worker.py waits for it
    listening.bind(path)
    listening.listen(64)
    workers, parent = {}, os.getppid()
    while os.getppid() == parent:         # the tests' server gone (pytest killed): so is this one
        if select.select([listening], [], [], 0.05)[0]:
            conn, _ = listening.accept()
            try:
                spec, fds = _receive(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listening.close()
                for other in workers.values():
                    other.close()
                _worker(conn, spec, fds, printed)
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"{pid}\n".encode())
            workers[pid] = conn
        while workers:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = workers.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        more = conn.recv(1 << 16)
        if not more:
            for fd in fds:
                os.close(fd)
            raise EOFError("worker.py went away")
        data += more
    return json.loads(data[8:8 + int.from_bytes(data[:8], "big")]), fds


@contextlib.contextmanager
def _captured():
    """What is printed to stdout and stderr inside (import-time warnings), by file descriptor:
    yields {1: bytes, 2: bytes}, filled on exit."""
    printed = {}
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
    try:
        for fd, f in files.items():
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(f.fileno(), fd)
        yield printed
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, f in files.items():
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            f.seek(0)
            printed[fd] = f.read()
            f.close()


def _worker(conn: socket.socket, spec: dict, fds: list[int], printed: dict) -> None:
    """In the forked worker: what `python -u argv...` does with the example, then _exit. It
    first prints what the server's imports printed (a warning at import, say), as a new
    interpreter importing them would: a test reading the launch's output sees it."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        for fd in (1, 2):
            os.write(fd, printed[fd])
        sys.stdin = open(0, closefd=False)
        # -u: unbuffered output, nothing lost when a worker is killed
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True,
                                      errors="backslashreplace")
        os.environ.clear()
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)   # a fresh interpreter's handlers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
        threading.Thread(target=_watch, args=(conn,), daemon=True).start()
        example, *args = spec["argv"]
        sys.argv = [example, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(example)))
        try:
            runpy.run_path(example, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) or exit_.code is None else 1
            if exit_.code is not None and not isinstance(exit_.code, int):
                print(exit_.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code or 0)


def _watch(conn: socket.socket) -> None:
    """worker.py sends nothing more: an end of file means it died (SIGKILL), and so must this worker."""
    with contextlib.suppress(OSError):
        conn.recv(1)
    os.kill(os.getpid(), signal.SIGKILL)


def finish(proc: Forked, ok: bool = True) -> str:
    """Wait for `proc`; assert it succeeded (`ok`) or failed (not `ok`, e.g. killed); its output."""
    text = proc.communicate(timeout=300)[0]
    assert (proc.returncode == 0) == ok, text[-3000:]
    return text


def read_wire(directory: Path, rank: int) -> dict:
    """What `--count` wrote for `rank`: the counter's summary and the optimizer's comm_stats."""
    return json.loads((directory / f"wire-rank{rank}.json").read_text())


def differs(a, b) -> bool:
    """Whether two saved states hold a tensor that differs (nested dicts and lists)."""
    if torch.is_tensor(a):
        return not torch.equal(a, b)
    if isinstance(a, dict):
        return any(differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return any(differs(x, y) for x, y in zip(a, b))
    return False
