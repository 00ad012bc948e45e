"""Runs that several files of tests/train check, each launched once (conftest.py's fixtures),
and how those files launch `thinwire compare` and `thinwire train`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

STEPS, SYNC_EVERY, COMPRESSED_AFTER = 24, 8, 0.5
# --sync-every reaches only LoRDO, DiLoCo and SparseLoCo, --compressed-after only APMSqueeze's dense warmup
TINY = ("--preset", "tiny", "--workers", "2", "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
        "--compressed-after", str(COMPRESSED_AFTER))
# compare launches each optimizer on workers of its own, so a run depends only on its name and
# the flags: one launch of the three files' optimizers gives each the runs it checks, and AdamW
# and DeMo train once instead of three and two times
TINY_OPTIMIZERS = ("adamw", "powersgd", "demo",                                  # test_cli.py; adamw: the baseline
                   "adamw-allreduce", "demo-overlap", "demo-lookahead",         # test_overlap_harness.py
                   "adam", "apmsqueeze", "muon", "ef21-muon", "lordo", "diloco",  # test_compare_all.py, with adamw
                   "sparseloco", "sparseloco-delayed")

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


def start(cmd: list[str], die: str | None = None) -> subprocess.Popen:
    """`cmd` started with train_env (and THINWIRE_DIE_AT=die), its output and errors captured
    together: launches that do not depend on each other run side by side (`wait`)."""
    env = train_env(**({"THINWIRE_DIE_AT": die} if die else {}))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    """A `start`ed process, finished: as subprocess.run would have returned it."""
    output = proc.communicate(timeout=timeout)[0]
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def run_train(out: Path, die: str | None = None) -> subprocess.CompletedProcess:
    """`thinwire train` of DeMo with TRAIN's flags, checkpointed every 4 steps; `die`: THINWIRE_DIE_AT."""
    return wait(start([sys.executable, "-m", "thinwire", *train_argv(out)], die))


def train_argv(out: Path, optimizer: str = "demo", *flags: str) -> list[str]:
    """run_train's command after `thinwire` (another optimizer, more flags: later ones win)."""
    return ["train", "--optimizer", optimizer, *TRAIN, "--out", str(out), "--checkpoint-every", "4", *flags]
