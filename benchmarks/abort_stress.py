"""Stress a short 3-process gloo job for process aborts (SIGABRT, `terminate called ...`).

    python benchmarks/abort_stress.py --runs 30                       # APMSqueeze, as issue 24 ran it
    python benchmarks/abort_stress.py --runs 30 --optimizer diloco --load "thinwire compare --preset tiny --quiet"
    python benchmarks/abort_stress.py --runs 20 --exit-race finalize   # the abort's cause, forced
    python benchmarks/abort_stress.py --runs 20 --exit-race os-exit    # ... and the harness's fix

Each run is a fresh `python` process that spawns 3 workers (`torch.multiprocessing.spawn`,
`file://` rendezvous), trains a small MLP for 40 steps with the optimizer, round-trips the
optimizer through `state_dict()`/`load_state_dict()` at step 25 and destroys the process
group. `--load CMD` keeps CMD running beside the runs (restarted when it ends), to load the
machine as a busy CI box would. Prints one line per run and a table: exit codes, aborts
(SIGABRT or `terminate called` in stderr) and other failures.

`--exit-race MODE` runs, instead, workers that leave an all_reduce in flight whose tensor
Python no longer holds and then end: `finalize` by returning (the interpreter finalizes
while gloo's thread finishes the collective and takes the GIL to free the tensor: the
abort), `os-exit` by `thinwire.train.launch.exit_process` (no finalization: no abort).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

STEPS, ROUND_TRIP_AT, WORLD = 40, 25, 3


def _make_optimizer(name: str, params):
    import thinwire
    if name == "apmsqueeze":
        return thinwire.APMSqueeze(params, lr=1e-3, warmup_steps=10)
    if name == "diloco":
        import torch
        return thinwire.DiLoCo(params, inner=lambda ps: torch.optim.AdamW(ps, lr=1e-3), sync_every=4)
    if name == "demo":
        return thinwire.DeMo(params, lr=1e-3)
    raise ValueError(f"--optimizer must be apmsqueeze, diloco or demo, got {name!r}")


def _worker(rank: int, rendezvous: str, optimizer: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = _make_optimizer(optimizer, model.parameters())
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == ROUND_TRIP_AT:
            state = opt.state_dict()
            opt.load_state_dict(state)
    dist.destroy_process_group()


def _race_worker(rank: int, rendezvous: str, mode: str) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    for _ in range(3):
        t = torch.randn(4_000_000)
        work = dist.all_reduce(t, async_op=True)
        del t, work                               # only gloo's thread holds the tensor now
    if mode == "os-exit":
        from thinwire.train.launch import exit_process
        exit_process(0)


def one_job(optimizer: str) -> None:
    """The job itself (run in a child `python` by `main`); 'race:MODE' is --exit-race's."""
    import torch.multiprocessing as mp
    fn, arg = (_race_worker, optimizer.split(":", 1)[1]) if optimizer.startswith("race:") else (lambda_free_worker,
                                                                                                    optimizer)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(os.path.join(tmp, "rendezvous"), arg), nprocs=WORLD)


def lambda_free_worker(rank: int, rendezvous: str, optimizer: str) -> None:
    _worker(rank, rendezvous, optimizer)


def _run_once(optimizer: str, timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, __file__, "--job", optimizer]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -999, "timeout"
    return done.returncode, done.stderr


class _Load:
    """CMD kept running (restarted when it ends) until stop()."""

    def __init__(self, cmd: str | None):
        self.cmd, self.proc = cmd, None

    def poll(self) -> None:
        if self.cmd and (self.proc is None or self.proc.poll() is not None):
            self.proc = subprocess.Popen(shlex.split(self.cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="jobs to run, one after another (default 30)")
    ap.add_argument("--optimizer", default="apmsqueeze", help="apmsqueeze (default), diloco or demo")
    ap.add_argument("--load", action="append", default=[],
                    help="a command kept running beside the jobs, e.g. a thinwire compare (repeatable)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    ap.add_argument("--exit-race", choices=("finalize", "os-exit"), default=None,
                    help="force the exit race instead of training (module docstring)")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.exit_race:
        args.optimizer = f"race:{args.exit_race}"
    if args.job:
        one_job(args.job)
        return
    loads, tally = [_Load(cmd) for cmd in args.load], {"ok": 0, "abort": 0, "other": 0}
    try:
        for i in range(args.runs):
            for load in loads:
                load.poll()
            t = time.perf_counter()
            code, err = _run_once(args.optimizer, args.timeout)
            aborted = "terminate called" in err or "SIGABRT" in err or "Signals.SIGABRT" in err
            kind = "ok" if code == 0 and not aborted else ("abort" if aborted else "other")
            tally[kind] += 1
            last = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"run {i + 1:3d}: {kind:5s} exit {code:4d} {time.perf_counter() - t:5.1f} s  {last[:100]}", flush=True)
            if kind != "ok":
                print(err[-3000:], file=sys.stderr, flush=True)
    finally:
        for load in loads:
            load.stop()
    print(f"\n| optimizer | runs | ok | aborts | other failures | load |\n|---|---|---|---|---|---|\n"
          f"| {args.optimizer} | {args.runs} | {tally['ok']} | {tally['abort']} | {tally['other']} | "
          f"{'; '.join(args.load) or 'none'} |")


if __name__ == "__main__":
    main()
