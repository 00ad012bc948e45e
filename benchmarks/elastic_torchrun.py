"""torchrun's elastic rendezvous on localhost (issue 27): a node leaves, a node joins.

    python benchmarks/elastic_torchrun.py                   # DeMo, tiny, 60 steps, 2 agents x 2 workers
    python benchmarks/elastic_torchrun.py --rdzv-conf ''    # torch's default rendezvous timers
    python benchmarks/elastic_torchrun.py --nproc 1 --steps 60 --checkpoint-every 5 --kill-at 8 --no-reference

Three `torchrun --nnodes 1:2 --rdzv-backend c10d` agents ("nodes") on this machine, each a
process group of its own (start_new_session), share one rendezvous and one --out:
  1. agent B, then A 1 s later (A hosts the rendezvous endpoint; B and C are told not to, and
     B waits for it): one run on 2 x nproc workers;
  2. once the log shows step `--kill-at`, B's process group (the agent) gets SIGKILL, and its
     workers die with it (PR_SET_PDEATHSIG, launch.init_from_env); A's workers fail on their
     next collective (PeerFailure), A's agent re-rendezvouses alone and restarts them on nproc
     workers, which resume from the latest complete checkpoint;
  3. `--join-after` seconds after their first step, agent C starts; A's agent sees a node
     waiting at its next monitoring interval, stops its workers and restarts the group with C
     on 2 x nproc workers, which resume from the latest checkpoint again;
  4. the run finishes. Its final validation loss is compared with `thinwire train` of the
     same flags on 2 x nproc workers, never interrupted.
Every agent line is timestamped as it arrives. The table's times come from those stamps, the
kill's and C's start's wall clock, and the log's `resume` records (`first_step_at`: the wall
clock at the end of the first step after the resume). THINWIRE_STEP_SLEEP paces the steps
(tiny's take milliseconds; the sleep is outside the step's timing) so that the kill and the
join land mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The rendezvous's timers (seconds): a dead node is dropped after keep_alive_interval x
# keep_alive_max_attempt without a heartbeat; a round with fewer than --nnodes' maximum of
# nodes completes last_call_timeout after its minimum is reached (torch's defaults: 5 x 3 and 30).
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(step_sleep: float) -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("THINWIRE_DIE_AT", "TORCHELASTIC_RESTART_COUNT")}
    # A node that joins later as rendezvous rank > 0 waits for the worker store's address, which a
    # rank 0 agent that shares its rendezvous store (torch's default) writes only in its first
    # round: torchrun fails the join after 60 s. Not sharing: every round gets a fresh store.
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", THINWIRE_STEP_SLEEP=str(step_sleep), LOGLEVEL="INFO",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return out


def agent_cmd(port: int, run_id: str, nproc: int, train: list[str], host: bool = True,
              conf: str = RDZV_CONF) -> list[str]:
    """One node: the elastic torchrun command, as README gives it, around `python -m thinwire.train`.
    `host` False: never host the rendezvous endpoint (on one machine every agent's hostname
    matches it and the first to bind it hosts; is_host=false makes that A, as on two machines)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", ",".join(c for c in (conf, "" if host else "is_host=false") if c), "--max-restarts", "3",
            "-m", "thinwire.train", *train]


class Agent:
    """A torchrun agent in a process group of its own; its output lines, timestamped."""

    def __init__(self, name: str, cmd: list[str], environ: dict, out_dir: Path):
        self.name, self.lines = name, []
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.file = open(out_dir / f"agent-{name}.log", "w")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            self.file.write(f"{time.time():.3f} {line}")
            self.file.flush()

    def first(self, text: str, after: float = 0.0) -> float | None:
        """The time of the first line after `after` that contains `text`."""
        return next((t for t, line in list(self.lines) if t >= after and text in line), None)

    def kill(self) -> float:
        """SIGKILL the agent and its workers (its process group); the time it was sent."""
        t = time.time()
        os.killpg(self.proc.pid, signal.SIGKILL)
        return t

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        self.file.close()
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def records(log: Path) -> list[dict]:
    """The run's log records so far (a line being written is skipped)."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def wait_for(what: str, predicate, timeout: float, agents: list[Agent]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    tails = "\n".join(f"--- agent {a.name} ---\n" + "\n".join(a.text().splitlines()[-30:]) for a in agents)
    raise TimeoutError(f"no {what} within {timeout:g} s\n{tails}")


def last_step(log: Path) -> int:
    return max((r["step"] for r in records(log) if r["kind"] == "step"), default=0)


def resume_to(log: Path, world: int) -> dict | None:
    return next((r for r in records(log) if r["kind"] == "resume" and r["world"] == world), None)


def scenario(out: Path, optimizer: str, nproc: int, train: list[str], kill_at: int, join_after: float,
             step_sleep: float, timeout: float = 300.0, conf: str = RDZV_CONF) -> dict:
    """Run steps 1-4 of the module docstring in `out`; the events' wall-clock times and the log."""
    port, environ, log = free_port(), env(step_sleep), out / f"{optimizer}.jsonl"
    train = ["--optimizer", optimizer, *train, "--out", str(out)]
    cmd, guest = (agent_cmd(port, f"thinwire-{port}", nproc, train, host, conf) for host in (True, False))
    ev = {"start": time.time()}
    # B first: it waits for A's endpoint, so both join the first round well inside its last call
    b = Agent("B", guest, environ, out)
    time.sleep(1.0)
    a = Agent("A", cmd, environ, out)
    agents = [a, b]
    try:
        wait_for("first step", lambda: last_step(log) >= 1, timeout, agents)
        ev["first_step_seen"] = time.time()
        wait_for(f"step {kill_at}", lambda: last_step(log) >= kill_at, timeout, agents)
        ev["killed_after_step"] = last_step(log)
        ev["kill"] = b.kill()
        ev["b_exit"] = b.wait(60)
        ev["shrunk"] = wait_for(f"a resume on {nproc} workers", lambda: resume_to(log, nproc), timeout, agents)
        ev["survivor_error"] = a.first("thinwire: error: rank", after=ev["kill"])
        time.sleep(join_after)
        ev["join"] = time.time()
        agents.append(Agent("C", guest, environ, out))
        ev["grown"] = wait_for(f"a resume on {2 * nproc} workers", lambda: resume_to(log, 2 * nproc), timeout,
                               agents)
        ev["a_exit"], ev["c_exit"] = a.wait(timeout), agents[2].wait(timeout)
        ev["end"] = time.time()
    finally:                                   # no agent outlives the scenario, whatever failed
        for x in agents:
            if x.proc.poll() is None:
                x.kill()
                x.wait(60)
    done = "Rendezvous complete for workers"             # the agents' INFO line (LOGLEVEL=INFO)
    ev["shrink_rdzv"], ev["grow_rdzv"] = a.first(done, after=ev["kill"]), a.first(done, after=ev["join"])
    ev["records"], ev["agents"] = records(log), {x.name: x.text() for x in agents}
    return ev

def reference_loss(out: Path, optimizer: str, workers: int, train: list[str]) -> float:
    """The final validation loss of the same run on `workers` workers, never interrupted."""
    cmd = [sys.executable, "-m", "thinwire", "train", "--optimizer", optimizer, *train, "--workers", str(workers),
           "--out", str(out)]
    done = subprocess.run(cmd, env=env(0.0), capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"reference run failed:\n{done.stderr[-3000:]}")
    return [r for r in records(out / f"{optimizer}.jsonl") if r["kind"] == "eval"][-1]["val_loss"]


def table(ev: dict, nproc: int, reference: float | None) -> str:
    t0, shrunk, grown = ev["start"], ev["shrunk"], ev["grown"]
    err = ev["survivor_error"]

    def at(t):
        return "" if t is None else f"{t - t0:.1f}"
    rows = [("start agents B, then A (1 s later)", at(t0), f"one run on {2 * nproc} workers"),
            ("log shows step 1", at(ev["first_step_seen"]), ""),
            ("SIGKILL agent B's process group", at(ev["kill"]), f"log at step {ev['killed_after_step']}"),
            ("A's workers fail (PeerFailure)", at(err), "" if err is None else f"{err - ev['kill']:.1f} s after the kill"),
            ("A's agent: rendezvous complete, alone", at(ev["shrink_rdzv"]), ""),
            (f"first step on {nproc} workers", at(shrunk["first_step_at"]),
             f"resumed {shrunk['checkpoint']}; {shrunk['first_step_at'] - ev['kill']:.1f} s after the kill; "
             f"worker start to first step {shrunk['time_to_recover_s']:.1f} s (load {shrunk['load_s']:.2f} s)"),
            ("start agent C", at(ev["join"]), ""),
            ("A's agent: rendezvous complete, with C", at(ev["grow_rdzv"]), ""),
            (f"first step on {2 * nproc} workers", at(grown["first_step_at"]),
             f"resumed {grown['checkpoint']}; {grown['first_step_at'] - ev['join']:.1f} s after C started; "
             f"worker start to first step {grown['time_to_recover_s']:.1f} s (load {grown['load_s']:.2f} s)"),
            ("run ends (A and C exit)", at(ev["end"]), f"exit codes A {ev['a_exit']}, C {ev['c_exit']}; "
                                                        f"B (killed) {ev['b_exit']}")]
    lines = ["| event | t (s) | |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    recs = ev["records"]
    steps = [r["step"] for r in recs if r["kind"] == "step"]
    final = next((r for r in recs if r["kind"] == "final"), {})
    loss = [r for r in recs if r["kind"] == "eval"][-1]["val_loss"]
    lines += ["", f"resumes in the log: " + ", ".join(f"step {r['step']} {r['old_world']} -> {r['world']} workers"
                                                       for r in recs if r["kind"] == "resume"),
              f"every step logged once, in order: {steps == list(range(1, len(steps) + 1))} ({len(steps)} steps)",
              f"replicas identical at the end: {final.get('replicas_identical')}",
              f"final validation loss: {loss:.4f}" + ("" if reference is None else
                                                      f"; uninterrupted {2 * nproc} workers {reference:.4f} "
                                                      f"({100 * (loss - reference) / reference:+.2f} %)")]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="demo")
    p.add_argument("--nproc", type=int, default=2, help="workers per agent (default 2)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=25, help="kill agent B once the log shows this step")
    p.add_argument("--join-after", type=float, default=2.0, help="start agent C this long after the first "
                   "step on the smaller world (seconds)")
    p.add_argument("--step-sleep", type=float, default=0.25, help="THINWIRE_STEP_SLEEP (seconds)")
    p.add_argument("--rdzv-conf", default=RDZV_CONF, help=f"torchrun --rdzv-conf ('' for torch's defaults; "
                   f"default {RDZV_CONF})")
    p.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run")
    p.add_argument("--out", help="directory to keep (default: a temporary one)")
    args = p.parse_args()
    base = ["--preset", "tiny", "--steps", str(args.steps), "--peer-timeout", "30", "--quiet"]
    train = [*base, "--checkpoint-every", str(args.checkpoint_every)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        (root / "run").mkdir(parents=True, exist_ok=True)
        ev = scenario(root / "run", args.optimizer, args.nproc, train, args.kill_at, args.join_after, args.step_sleep,
                      conf=args.rdzv_conf)
        ref = None if args.no_reference else reference_loss(root / "reference", args.optimizer, 2 * args.nproc, base)
        print(table(ev, args.nproc, ref))


if __name__ == "__main__":
    main()
