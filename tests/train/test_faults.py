"""Faults on real processes (issue 16): a worker SIGKILLed under `torchrun --max-restarts 1`
is restarted with its group, which resumes from the last checkpoint and ends with the same
parameters as a run never interrupted (bit for bit); a worker that dies or goes silent with
nothing to restart it makes every survivor exit with an error naming the step, within the
peer timeout; a truncated checkpoint is a clear error naming the previous one, which reads.

Faults are injected by THINWIRE_DIE_AT="rank:step[:stop|:save]" (train/worker.py): that rank
SIGKILLs (or SIGSTOPs) itself as it starts that step, or SIGKILLs itself inside that step's
checkpoint write before writing its shard (save), on torchrun's first attempt only.
DeMo and one optimizer of each other family: APMSqueeze, EF21-Muon, LoRDO.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.train.shared import TRAIN, TRAIN_MAIN, Forked, cli_here, run_train, start, train_argv, train_env
from thinwire.train.checkpoint import CheckpointError, check, checkpoint_root, expected_meta, latest, read_model
from thinwire.train.config import get_preset

OPTIMIZERS = ["demo", "apmsqueeze", "ef21-muon", "lordo"]
# APMSqueeze needs 5 dense warmup steps: its run is 12 steps long (warmup 5), so that the kill
# (step 10) and the checkpoint it resumes from (step 8) fall in its 1-bit phase, errors and all
STEPS = {"apmsqueeze": 12}
FLAGS = {"apmsqueeze": ["--apmsqueeze-compressed-after", "0.42"]}
SETTINGS = {"apmsqueeze": {"apmsqueeze_compressed_after": 0.42}}


@pytest.fixture(scope="module")
def preloaded_env():
    """train_env naming a server that imported `python -m thinwire.train`'s modules once
    (tests.integrations.launch.preloaded, running train_main.py): _torchrun's workers fork
    from it."""
    from tests.integrations.launch import preloaded
    with preloaded(TRAIN_MAIN, train_env()) as env:
        yield env


def _torchrun(out: Path, optimizer: str, restarts: int, env: dict) -> Forked:
    """The agent forked from the tests' server (shared.start); it starts its workers, and
    restarts them, as torchrun does: new interpreters, each worker.py standing in for
    `python -m thinwire.train` (train_main.py) forked from `env`'s preloaded server (~7 s of
    CPU fewer a worker; the same code, in the environment torchrun gave that interpreter)."""
    from tests.integrations.launch import PRELOADED, WORKER
    assert PRELOADED in env, "env must come from the preloaded_env fixture"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "--monitor-interval", "0.2",
           str(WORKER), str(TRAIN_MAIN), "--optimizer", optimizer, *TRAIN, "--out", str(out),
           "--checkpoint-every", "4", "--peer-timeout", "20",
           "--steps", str(STEPS.get(optimizer, 8)), *FLAGS.get(optimizer, [])]
    return start(cmd, env=env)


def _never_killed(out: Path, optimizer: str) -> str:
    """The same run as `_torchrun`'s, never killed, by `thinwire train` in this process (the
    harness's launcher and workers' code; no agent, no interpreters to start: ~16 s of CPU
    fewer than a torchrun launch of 2 workers). What it printed."""
    said = cli_here(*train_argv(out, optimizer, "--peer-timeout", "20", "--steps", str(STEPS.get(optimizer, 8)),
                                *FLAGS.get(optimizer, [])))
    return said["stdout"] + said["stderr"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sigkill_under_torchrun_restarts_and_ends_bit_identical(optimizer, tmp_path, demo_never_killed,
                                                                preloaded_env):
    """The run never killed is `thinwire train`'s, launched by the harness (the same flags, the
    same workers' code): DeMo's conftest's, the others' here while the killed one runs."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    steps = STEPS.get(optimizer, 8)
    run = _torchrun(killed, optimizer, 1, {**preloaded_env, "THINWIRE_DIE_AT": f"1:{steps - 2}"})
    try:
        said = "" if optimizer == "demo" else _never_killed(whole, optimizer)
    finally:
        out = run.communicate(timeout=240)[0]
    assert run.returncode == 0, out[-3000:]
    assert "resuming" not in said
    whole = demo_never_killed if optimizer == "demo" else whole
    resumed = f"step-{steps - 4:06d}"
    assert f"resuming {optimizer} from {checkpoint_root(killed) / resumed} (step {steps - 4} of {steps})" in out, out
    a = read_model(checkpoint_root(whole) / f"step-{steps:06d}")
    b = read_model(checkpoint_root(killed) / f"step-{steps:06d}")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]

    # a truncated checkpoint of this optimizer is a clear error; the previous one still reads
    last = checkpoint_root(killed) / f"step-{steps:06d}"
    shard = last / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    cfg = get_preset("tiny", steps=steps, eval_every=4, eval_rows=16, workers=2, sync_every=3,
                     **SETTINGS.get(optimizer, {}))
    meta = expected_meta(cfg, optimizer, __import__("json").loads((last / "thinwire.json").read_text())["lr"], 2)
    with pytest.raises(CheckpointError, match=rf"corrupt: __0_0.distcp .* previous checkpoint .*{resumed}"):
        check(last, meta)
    previous = checkpoint_root(killed) / resumed
    assert check(previous, meta)["step"] == steps - 4 and read_model(previous).keys() == a.keys()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workers(out: Path, optimizer: str, world: int, die: str, timeout: float) -> list[Forked]:
    """`world` workers as torchrun would start them (its environment), with no agent to restart
    (or kill) anyone; each `python -m thinwire.train` forked from the tests' server (shared.start)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = train_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), THINWIRE_DIE_AT=die)
        cmd = [sys.executable, "-m", "thinwire.train", "--optimizer", optimizer, *TRAIN, "--workers", str(world),
               "--out", str(out), "--checkpoint-every", "4", "--peer-timeout", str(timeout),
               "--steps", str(STEPS.get(optimizer, 8)), *FLAGS.get(optimizer, [])]
        procs.append(start(cmd, env=env))
    return procs


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_dead_peer_without_restarts_every_survivor_fails_clearly(optimizer, tmp_path):
    procs = _workers(tmp_path, optimizer, 3, "1:6", timeout=20)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert procs[1].returncode == -signal.SIGKILL
    for rank in (0, 2):
        assert procs[rank].returncode == 1, outs[rank][-3000:]
        assert f"thinwire: error: rank {rank} of 3: step 6: a peer died or did not answer" in outs[rank], outs[rank]
    root = checkpoint_root(tmp_path)
    assert latest(root).name == "step-000004"                    # nothing after it, nothing half-written
    assert not list(root.glob("*.tmp"))


def test_silent_peer_fails_every_survivor_within_the_peer_timeout(tmp_path):
    """A peer that stops answering (SIGSTOP) rather than dying: the survivors' collectives time
    out after --peer-timeout seconds and each exits with the error, never hanging."""
    timeout = 4.0
    procs = _workers(tmp_path, "demo", 3, "1:6:stop", timeout=timeout)
    try:
        while not (tmp_path / "checkpoint" / "step-000004").exists():      # the peer stops right after this
            assert procs[0].poll() is None, procs[0].communicate()[0]
            time.sleep(0.05)
        t0 = time.monotonic()
        for rank in (0, 2):
            procs[rank].wait(timeout=timeout + 30)
        waited = time.monotonic() - t0
    finally:
        procs[1].kill()
    outs = [p.communicate()[0] for p in procs]
    for rank in (0, 2):
        assert procs[rank].returncode == 1, outs[rank][-3000:]
        assert f"rank {rank} of 3: step 6: a peer died or did not answer within the peer timeout (4 s)" in outs[rank]
    assert waited < timeout + 30
    assert latest(checkpoint_root(tmp_path)).name == "step-000004"


@pytest.fixture(scope="module")
def never_killed(demo_never_killed):
    return read_model(checkpoint_root(demo_never_killed) / "step-000008")


def test_thinwire_train_killed_while_writing_a_checkpoint_then_run_again_ends_bit_identical(never_killed, tmp_path):
    """The issue's acceptance run: `thinwire train ... --checkpoint-every N --out D`, a worker
    killed in the middle of writing checkpoint 8 (rank 0 wrote its shard, rank 1 is SIGKILLed
    before writing its own), then the same command again: it skips the half-written
    step-000008.tmp saying why, takes step 4, and ends with the parameters of a run never killed."""
    killed = tmp_path / "killed"
    root = checkpoint_root(killed)
    first = run_train(killed, die="1:8:save")
    assert first.returncode == 1, first.stdout[-3000:]
    assert "thinwire: error: worker 1 of 2 died (signal SIGKILL)" in first.stdout
    assert "thinwire: error: rank 0 of 2: step 8: a peer died" in first.stdout      # the survivor's own error
    assert "Run the same command again to resume" in first.stdout
    half = root / "step-000008.tmp"
    assert (half / "__0_0.distcp").is_file() and not (half / "__1_0.distcp").exists()   # one rank wrote
    assert not (root / "step-000008").exists() and latest(root).name == "step-000004"
    said = cli_here(*train_argv(killed))            # the same command, in this process (~9 s of CPU fewer)
    again = said["stdout"] + said["stderr"]
    skip = [line for line in again.splitlines() if "skipped incomplete checkpoint" in line]
    assert skip == ["thinwire: skipped incomplete checkpoint step-000008.tmp (no thinwire.json, 1 file(s) written: "
                    "a rank stopped while writing it); resuming from step-000004 (step 4)"], again[-3000:]
    assert "resuming demo from" in again and "(step 4 of 8)" in again
    b = read_model(root / "step-000008")
    assert never_killed.keys() == b.keys() and all(torch.equal(never_killed[k], b[k]) for k in b)
    assert not list(root.glob("*.tmp"))                          # the resumed run's own write replaced it


def test_killing_thinwire_train_itself_kills_its_workers_and_the_same_command_resumes(tmp_path):
    """SIGKILL to the launcher: its workers die with it (no orphan keeps writing to --out) and
    the same command again resumes from the last complete checkpoint and finishes."""
    cmd = [sys.executable, "-m", "thinwire", "train", "--optimizer", "demo", *TRAIN, "--steps", "40",
           "--eval-every", "20", "--out", str(tmp_path), "--checkpoint-every", "4"]
    proc = start(cmd, fork_workers=False)            # the harness's own forkserver: its workers are not our children
    while not (checkpoint_root(tmp_path) / "step-000004").exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    proc.kill()
    proc.communicate()
    time.sleep(1.0)
    log = tmp_path / "demo.jsonl"
    size = log.stat().st_size
    time.sleep(1.5)
    assert log.stat().st_size == size                                  # nobody is still training
    assert not (checkpoint_root(tmp_path) / "step-000040").exists()
    said = cli_here(*cmd[3:])                       # the same command, in this process (~9 s of CPU fewer)
    assert "resuming demo from" in said["stderr"] and "of 40)" in said["stderr"]
    assert latest(checkpoint_root(tmp_path)).name == "step-000040"


def test_only_collective_failures_count_as_dead_peers():
    from thinwire.optim.protocol import NonFiniteGradientError, PeerMismatchError
    from thinwire.train.worker import peer_failed
    assert peer_failed(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert peer_failed(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms"))
    assert not peer_failed(PeerMismatchError("peer 1 sent step 3, this rank expects step 4"))
    assert not peer_failed(NonFiniteGradientError("non-finite gradients on rank 1"))
    assert not peer_failed(ValueError("bad argument"))
