"""Runs that several files of tests/train check, each launched once (conftest.py's fixtures),
and how those files launch `thinwire compare` and `thinwire train`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS, SYNC_EVERY, COMPRESSED_AFTER = 24, 8, 0.5
# --sync-every reaches only LoRDO, DiLoCo and SparseLoCo, --compressed-after only APMSqueeze's dense warmup
TINY = ("--preset", "tiny", "--workers", "2", "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
        "--apmsqueeze-compressed-after", str(COMPRESSED_AFTER))
# compare launches each optimizer on workers of its own, so a run depends only on its name and
# the flags: one launch of the three files' optimizers gives each the runs it checks, and AdamW
# and DeMo train once instead of three and two times
TINY_OPTIMIZERS = ("adamw", "powersgd", "demo",                                  # test_cli.py; adamw: the baseline
                   "adamw-allreduce", "demo-overlap", "demo-lookahead",         # test_overlap_harness.py
                   "adam", "apmsqueeze", "muon", "ef21-muon", "lordo", "diloco",  # test_compare_all.py, with adamw
                   "sparseloco", "sparseloco-delayed", "sign-demo")             # sign-demo: test_compare_all.py

# `python -m thinwire.train` as a script, for torchrun workers forked from a preloaded server
# (tests.integrations.launch.preloaded): test_faults.py's and test_elastic_torchrun.py's
TRAIN_MAIN = Path(__file__).resolve().parent / "train_main.py"

# test_faults.py's runs; the same DeMo run never interrupted is test_checkpoint.py's too (its TINY)
TRAIN = ["--preset", "tiny", "--steps", "8", "--eval-every", "4", "--eval-rows", "16", "--workers", "2",
         "--sync-every", "3", "--quiet"]


def compare_here(out: Path, *args: str) -> dict:
    """`thinwire compare *args --out out --quiet`, by its own main in this process, its printed
    table captured: the workers fork from this session's server, and no interpreter, torch
    import or server of its own starts (~9 s of CPU a launch). summary.json, its rows by
    optimizer, each optimizer's log records by kind (step, eval, final) and the printed table."""
    return read_compare(out, cli_here("compare", *args, "--out", str(out), "--quiet")["stdout"], *args)


def cli_here(*argv: str) -> dict:
    """`thinwire *argv` run by its main in this process; what it printed, by stream. Where the
    command would exit non-zero (a user error, a worker that died), an AssertionError with
    what it printed."""
    from thinwire.train.cli import main
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            main(list(argv))
    except SystemExit as exit_:
        raise AssertionError(f"thinwire {' '.join(argv)} exited {exit_.code}: {stderr.getvalue()[-3000:]}") from None
    return {"stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def read_compare(out: Path, stdout: str, *args: str) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    logs = {}
    for name in args[args.index("--optimizers") + 1].split(","):
        lines = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        logs[name] = {k: [r for r in lines if r["kind"] == k] for k in ("step", "eval", "final")}
    return {"summary": summary, "rows": {r["optimizer"]: r for r in summary["runs"]}, "logs": logs,
            "stdout": stdout}


def train_env(**extra) -> dict:
    """This environment without fault injection or a torchrun restart count, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("THINWIRE_DIE_AT", "TORCHELASTIC_RESTART_COUNT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def start(cmd: list[str], die: str | None = None, env: dict | None = None, fork_workers: bool = True,
          namespace: str | None = None) -> "Forked":
    """`cmd` (`[sys.executable, "-m", module, *argv]`) started with train_env (and
    THINWIRE_DIE_AT=die) or `env`, its output and errors captured together: launches that do
    not depend on each other run side by side (`wait`). The process is forked (`Forked`), and
    so are its harness workers unless `fork_workers` is False (`_run_module`). `namespace`: a
    network namespace the process (and the workers it forks) runs in."""
    assert cmd[:2] == [sys.executable, "-m"], cmd
    return Forked(cmd, env if env is not None else train_env(**({"THINWIRE_DIE_AT": die} if die else {})),
                  fork_workers, namespace)


def _run_module(argv: list[str], env: dict, output: str, fork_workers: bool = True,
                namespace: str | None = None) -> None:
    """In the forked process: `python -m argv[0] argv[1:]` in environment `env`, stdout and
    stderr both to the file `output` (unbuffered, as PYTHONUNBUFFERED=1 makes them).

    `fork_workers`: the harness's launcher (thinwire.train.launch) forks its workers from this
    process, which has torch and thinwire imported already, instead of starting a forkserver of
    its own: a fresh interpreter importing launch.PRELOAD, ~7 s of CPU for every launch here, as
    this process is the tests' server's child and has no server it may reuse. The workers run
    the same code (launch._entry) with this environment (THINWIRE_DIE_AT, THINWIRE_STEP_SLEEP);
    only a test of how the forkserver's workers die with their launcher needs the server."""
    import runpy
    import signal

    import torch
    if namespace:                        # the forked child has one thread: its workers inherit the namespace
        from thinwire.train.netns import enter_namespace
        enter_namespace(namespace)
    if fork_workers:
        from thinwire.train import launch
        launch.start_method = lambda: "fork"
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(output, os.O_WRONLY | os.O_APPEND)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)      # a fresh interpreter's handlers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))   # read at torch's import
    sys.argv = [argv[0], *argv[1:]]
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) or exit_.code is None else 1
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


class Forked:
    """`python -m module argv...` as a real process of its own, forked from the tests' server
    (tests.dist: torch and thinwire already imported) instead of a new interpreter: ~3 s of CPU
    fewer a launch, dozens of launches in tests/train. It runs the module as `python -m` does
    (runpy, as __main__, with this argv and environment); what it prints goes to a file. The
    part of subprocess.Popen the tests use: poll, wait, communicate (output and errors in one
    text, None), kill, returncode (negative: the signal that ended it), args, pid."""

    def __init__(self, cmd: list[str], env: dict, fork_workers: bool = True, namespace: str | None = None):
        from tests.dist import _context
        self.args, self._text = cmd, None
        fd, self._output = tempfile.mkstemp(prefix="forked-", suffix=".log")
        os.close(fd)
        self._proc = _context().Process(target=_run_module, args=(cmd[2:], env, self._output, fork_workers, namespace),
                                        daemon=False)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        if self._text is None:
            with open(self._output, errors="replace") as f:
                self._text = f.read()
            os.unlink(self._output)
        return self._text, None

    def kill(self) -> None:
        self._proc.kill()


def wait(proc: Forked, timeout: float = 240) -> subprocess.CompletedProcess:
    """A `start`ed process, finished: as subprocess.run would have returned it."""
    output = proc.communicate(timeout=timeout)[0]
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def run_train(out: Path, die: str | None = None) -> subprocess.CompletedProcess:
    """`thinwire train` of DeMo with TRAIN's flags, checkpointed every 4 steps; `die`: THINWIRE_DIE_AT."""
    return wait(start([sys.executable, "-m", "thinwire", *train_argv(out)], die))


def train_argv(out: Path, optimizer: str = "demo", *flags: str) -> list[str]:
    """run_train's command after `thinwire` (another optimizer, more flags: later ones win)."""
    return ["train", "--optimizer", optimizer, *TRAIN, "--out", str(out), "--checkpoint-every", "4", *flags]
