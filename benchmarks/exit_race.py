"""The exit race (issue 46): a plain 3-process user loop, run again and again, counting aborts.

    python benchmarks/exit_race.py --runs 30 --load     # the issue's measurement (both variants)
    python benchmarks/exit_race.py --runs 3              # a quick check that it works
    python benchmarks/exit_race.py --variants torch --runs 30 --load
    python benchmarks/exit_race.py --write DIR           # only write the two loops, to read or run

Two loops are written to a temporary folder, each a plain `python FILE` a user would write:

    thinwire  issue 24's user loop: 3 workers (`torch.multiprocessing.spawn`, gloo, `file://`
              rendezvous), an MLP, `thinwire.APMSqueeze(lr=1e-3, warmup_steps=10)`, 40 steps,
              `state_dict()`/`load_state_dict()` at step 25, `dist.destroy_process_group()`
              and a normal return: no `os._exit`, no `thinwire.integrations.end_worker`.
    torch     the control: the same processes, model and exit, plain torch collectives in
              APMSqueeze's shape, fresh tensors every step as a user writes them: an all_gather
              (the handshake) at step 0, an async all_reduce + wait for the 10 warmup steps,
              then an async all_to_all_single with a zero own split + wait and an
              all_gather_into_tensor per step; torch.optim.Adam moves the parameters.

Each run is a fresh `python FILE`; the variants take turns, so both see the same load.
`--load` keeps `thinwire compare --preset tiny --quiet` running beside them (restarted when it
ends), as in the issue. A run is an abort when its exit code or stderr shows SIGABRT or
`terminate called` (the C++ runtime's message when gloo's thread is ended inside a noexcept
frame at interpreter shutdown), whether or not every worker had printed `done` first; any
other non-zero exit, or a timeout, is another failure. Prints a line per run and a table:
variant, runs, aborts, other failures, median seconds.

The thinwire loop goes through `thinwire.comm.Communicator`, whose `exit_guard` makes a normal
exit wait until gloo's thread has let go of every tensor it was handed; the control has no such
wait, so it shows torch's own rate.

Cost, measured on the shared 2-core machine (load average ~9 from other work): a run took
31-76 s alone and 61-104 s beside the load, so `--runs 30` (60 runs) takes about 45 minutes
and `--runs 30 --load` about 80; a quiet machine is faster. `--variants thinwire` halves it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Shared by both loops: the processes, the model, the data and the exit.
_HEAD = '''\
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, STEPS, ROUND_TRIP_AT, WARMUP = 3, 40, 25, 10


def setup(rank, rendezvous):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
'''

_TAIL = '''

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)
'''

_THINWIRE = _HEAD + '''

def worker(rank, rendezvous):
    import thinwire
    model = setup(rank, rendezvous)
    opt = thinwire.APMSqueeze(model.parameters(), lr=1e-3, warmup_steps=WARMUP)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        loss = model(torch.randn(16, 32, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == ROUND_TRIP_AT:
            opt.load_state_dict(opt.state_dict())
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
''' + _TAIL

_TORCH = _HEAD + '''

def exchange(step, params, rank):
    """APMSqueeze's collectives on fresh tensors, as a plain user would write them."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    if step == 0:                                         # the handshake: a small all_gather
        mine = torch.tensor([len(params), flat.numel()], dtype=torch.int64)
        dist.all_gather([torch.empty_like(mine) for _ in range(WORLD)], mine)
    if step < WARMUP:                                     # dense warmup: async all_reduce + wait
        buf = torch.cat([flat, torch.zeros(4)])
        dist.all_reduce(buf, async_op=True).wait()
        return buf[:flat.numel()] / WORLD
    n = -(-flat.numel() // (8 * WORLD)) * 8 * WORLD       # 1-bit phase 1: chunk bytes to peers
    part = 8 + 4 + n // WORLD // 8
    send = torch.randint(0, 255, (WORLD * part,), dtype=torch.uint8)
    others = torch.cat([send[:rank * part], send[(rank + 1) * part:]])
    arrived = torch.empty_like(others)
    splits = [0 if j == rank else part for j in range(WORLD)]
    dist.all_to_all_single(arrived, others, splits, splits, async_op=True).wait()
    out = torch.empty(WORLD * (4 + n // WORLD // 8), dtype=torch.uint8)   # phase 2
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # torch >= 2.10's name
    gather(out, torch.randint(0, 255, (4 + n // WORLD // 8,), dtype=torch.uint8))
    return flat.sign() * arrived.float().mean() * 1e-3


def worker(rank, rendezvous):
    model = setup(rank, rendezvous)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        loss = model(torch.randn(16, 32, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        mean, offset = exchange(step, params, rank), 0
        for p in params:
            p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        if step == ROUND_TRIP_AT:
            opt.load_state_dict(opt.state_dict())
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
''' + _TAIL

LOOPS = {"thinwire": _THINWIRE, "torch": _TORCH}
ABORT_SIGNS = ("terminate called", "SIGABRT")


def write_loops(folder: str) -> dict[str, str]:
    """Each variant's loop as `folder/<variant>_loop.py`; returns variant -> path."""
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for name, text in LOOPS.items():
        paths[name] = os.path.join(folder, f"{name}_loop.py")
        with open(paths[name], "w") as f:
            f.write(text)
    return paths


def run_once(path: str, timeout: float) -> dict:
    """One `python path`: its kind ('ok', 'abort', 'other'), exit code, seconds, workers done, stderr."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = None, _text(exc.stdout), _text(exc.stderr) + "\n(timeout)"
    seconds = time.perf_counter() - start
    # a child's abort makes mp.spawn's parent exit 1 with ProcessExitedException naming SIGABRT
    aborted = code in (-6, 134) or any(sign in err for sign in ABORT_SIGNS)
    kind = "abort" if aborted else "ok" if code == 0 else "other"
    return {"kind": kind, "code": code, "seconds": seconds, "done": out.count(" done"), "stderr": err}


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


class Load:
    """`thinwire compare --preset tiny --quiet --out TMP` kept running (restarted when it ends)
    until stop(); its own process group, so stop() ends the workers it spawned too."""

    def __init__(self, enabled: bool, folder: str):
        exe = shutil.which("thinwire", path=os.path.dirname(sys.executable)) or shutil.which("thinwire")
        self.cmd = [exe, "compare", "--preset", "tiny", "--quiet", "--out", os.path.join(folder, "load")]
        self.enabled, self.proc, self.started = enabled, None, 0

    def poll(self) -> None:
        if self.enabled and (self.proc is None or self.proc.poll() is not None):
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
            self.started += 1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)              # the group this Popen created, nothing else
            self.proc.wait()


def report(results: dict[str, list[dict]], load: str) -> str:
    """The table: variant, runs, aborts, other failures, median seconds."""
    lines = ["| variant | runs | aborts | other failures | median s | load |", "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        aborts = sum(r["kind"] == "abort" for r in runs)
        other = sum(r["kind"] == "other" for r in runs)
        median = statistics.median(r["seconds"] for r in runs) if runs else float("nan")
        lines.append(f"| {name} | {len(runs)} | {aborts} | {other} | {median:.1f} | {load} |")
    return "\n".join(lines)


def measure(paths: dict[str, str], runs: int, load: Load, timeout: float) -> dict[str, list[dict]]:
    """`runs` runs of each variant, taking turns; a line per run, stderr's tail on a failure."""
    results: dict[str, list[dict]] = {name: [] for name in paths}
    for i in range(runs):
        for name, path in paths.items():
            load.poll()
            r = run_once(path, timeout)
            results[name].append(r)
            last = r["stderr"].strip().splitlines()[-1][:90] if r["stderr"].strip() else ""
            print(f"run {i + 1:3d} {name:8s} {r['kind']:5s} exit {str(r['code']):>4s} {r['seconds']:5.1f} s "
                  f"done {r['done']}/3  {last}", flush=True)
            if r["kind"] != "ok":
                print(r["stderr"][-2000:], file=sys.stderr, flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="runs of each variant (default 30)")
    ap.add_argument("--variants", default="thinwire,torch", help="comma-separated: thinwire, torch (default both)")
    ap.add_argument("--load", action="store_true", help="keep `thinwire compare --preset tiny --quiet` running beside")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung (default 300)")
    ap.add_argument("--write", metavar="DIR", help="only write the loops into DIR and print their paths")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(LOOPS))
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {sorted(LOOPS)}")
    if args.write:
        for path in write_loops(args.write).values():
            print(path)
        return
    with tempfile.TemporaryDirectory(prefix="exit_race_") as folder:
        paths = {name: path for name, path in write_loops(folder).items() if name in names}
        load = Load(args.load, folder)
        start = time.perf_counter()
        try:
            results = measure(paths, args.runs, load, args.timeout)
        finally:
            load.stop()
        print(f"\n{report(results, 'thinwire compare --preset tiny' if args.load else 'none')}\n"
              f"{time.perf_counter() - start:.0f} s in all; load started {load.started} time(s)")


if __name__ == "__main__":
    main()
