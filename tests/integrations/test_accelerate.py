"""examples/accelerate_train.py, the README's Accelerate recipe, under torchrun with 2 gloo
processes:
- every collective counted (`CollectiveCounter`): none in backward, the optimizer's bytes as
  its comm_stats counts them and, for LoRDO, as its wire format gives them by hand; the same
  run under Accelerate's defaults (`--plain-ddp`) all-reduces every gradient every step, so
  the 0 is not a counting mistake;
- a run resumed by thinwire's `load_state` (Accelerate's, checked) ends bit for bit where the
  uninterrupted run ends, on both ranks, with rank 1's own optimizer state (it differs from
  rank 0's, and names its rank and run) restored; replicas identical. DeMo's run is killed while
  its step-10 checkpoint is written (rank 1 dies after rank 0 wrote its part; total_limit=1)
  and resumed with "last": it skips that checkpoint saying why and takes step 5's; LoRDO's
  resumes from a path, its uninterrupted run's checkpoint (one launch fewer);
- no FutureWarning in any launch's output (the buffer sync is stopped by its current name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integrations.launch import Forked, differs, finish, preloaded, read_wire, torchrun
from tests.optim.registry import HANDSHAKE, dense_bytes
from tests.train.shared import train_env
from thinwire.integrations.commit import MARK
from thinwire.train.config import get_preset
from thinwire.train.model import build_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_train.py"
STEPS, SAVE_EVERY = 20, 10      # the whole runs: checkpoint_0 at step 10 (LoRDO: between syncs), checkpoint_1 at 20
EVERY, CUT = 5, 10              # the killed run checkpoints every 5 steps, keeps 1, and dies while writing step 10's
RUNS = ("demo", "lordo")
KILLED = "demo"                 # killed mid-save and resumed ("last") in its directory; LoRDO from a path


def _torchrun(env: dict, optimizer: str, out: Path, *flags: str) -> Forked:
    return torchrun(EXAMPLE, "--optimizer", optimizer, "--steps", str(STEPS), "--out", str(out), *flags, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with preloaded(EXAMPLE, train_env()) as env:      # Accelerate imported once, not by each of 12 workers
        return _runs(tmp_path_factory, env)


def _runs(tmp_path_factory, env: dict) -> dict:
    """{optimizer: its run directories and "checkpoint", its whole run's at step 10}, KILLED's
    "left" (what its killed run left), the plain-DDP baseline, and every launch's "output":
    four launches, then two."""
    root = tmp_path_factory.mktemp("accelerate")
    dirs = {name: {"whole": root / f"{name}-whole", "resumed": root / f"{name}-resumed"} for name in RUNS}
    killed = dirs[KILLED]["killed"] = dirs[KILLED]["resumed"] = root / f"{KILLED}-killed"
    for d in dirs.values():
        d["checkpoint"] = d["whole"] / "checkpoints" / "checkpoint_0"
    cut = ("--save-every", str(EVERY), "--keep", "1")
    first = [(_torchrun(env, n, dirs[n]["whole"], "--count", "--save-every", str(SAVE_EVERY)), True) for n in RUNS]
    first.append((_torchrun(env, KILLED, killed, *cut, "--kill-mid-save", str(CUT)), False))
    dirs["plain"] = root / "plain"
    first.append((_torchrun(env, "demo", dirs["plain"], "--plain-ddp", "--count"), True))
    dirs["output"] = [finish(proc, ok) for proc, ok in first]
    dirs[KILLED]["left"] = {p.name: sorted(f.name for f in p.iterdir()) for p in (killed / "checkpoints").iterdir()}
    dirs[KILLED]["params_left"] = sorted(p.name for p in killed.glob("params-rank*.pt"))
    second = [_torchrun(env, KILLED, killed, *cut, "--resume", "last"),
              _torchrun(env, "lordo", dirs["lordo"]["resumed"], "--resume", str(dirs["lordo"]["checkpoint"]))]
    dirs["output"] += [finish(proc) for proc in second]
    return dirs


def test_killed_mid_save_leaves_the_checkpoint_before_it_complete(runs):
    """Rank 1 died inside save_state at step 10 (checkpoint_1) once rank 0 had written its part
    there: checkpoint_1 has no commit mark, and checkpoint_0 (step 5) survived total_limit=1."""
    left = runs[KILLED]["left"]
    assert sorted(left) == ["checkpoint_0", "checkpoint_1"] and not runs[KILLED]["params_left"]
    assert MARK in left["checkpoint_0"] and "custom_checkpoint_0.pkl" in left["checkpoint_0"]
    cut = set(left["checkpoint_1"])
    assert "random_states_0.pkl" in cut and "random_states_1.pkl" not in cut and MARK not in cut


@pytest.mark.parametrize("optimizer", RUNS)
def test_resumed_by_load_state_ends_bit_identical(runs, optimizer):
    d = runs[optimizer]
    for rank in (0, 1):
        a, b = (torch.load(d[k] / f"params-rank{rank}.pt") for k in ("whole", "resumed"))
        assert torch.equal(a, b), f"rank {rank} resumed elsewhere"
    assert torch.equal(torch.load(d["whole"] / "params-rank0.pt"), torch.load(d["whole"] / "params-rank1.pt"))
    saved = torch.load(d["checkpoint"] / "custom_checkpoint_0.pkl", weights_only=False)
    assert saved["world"] == 2 and [i["rank"] for i in saved["identities"]] == [0, 1]
    assert saved["run"] == json.loads((d["checkpoint"] / MARK).read_text())["run"]
    first, second = saved["ranks"]
    assert differs(first, second)                                    # rank 1's state is its own
    if optimizer == KILLED:                                          # it said where it resumed, and why
        output, checkpoints = runs["output"][-2], d["killed"] / "checkpoints"
        assert f"thinwire: skipping {checkpoints / 'checkpoint_1'}: it has no commit mark" in output
        assert f"resumed from {checkpoints / 'checkpoint_0'} at step {EVERY}\n" in output
        assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_3"]   # step 20's, total_limit=1
        assert (checkpoints / "checkpoint_3" / MARK).is_file()


def test_no_future_warning_in_an_accelerate_launch(runs):
    """thinwire's recipe stops DDP's buffer sync by forward_sync_buffers, not by the deprecated
    broadcast_buffers that torch 2.13 warns about."""
    assert len(runs["output"]) == 6
    for output in runs["output"]:
        assert "FutureWarning" not in output, output[-3000:]


@pytest.mark.parametrize("optimizer", RUNS)
def test_no_gradient_bytes_and_the_optimizer_sends_its_wire_format(runs, optimizer):
    steps = STEPS
    sizes = [p.numel() for p in build_model(get_preset("tiny")).parameters()]
    for rank in (0, 1):
        wire = read_wire(runs[optimizer]["whole"], rank)
        counted = wire["counter"]
        assert "backward" not in counted                              # not one collective in backward
        assert counted["optimizer_steps"] == steps                    # one step() per 2 micro-batches
        optimizer_bytes = sum(op["bytes"] for op in counted["optimizer"].values())
        assert optimizer_bytes == wire["comm_stats"]["totals"]["payload_bytes"]
        if optimizer == "lordo":                                      # the handshake, 5 syncs of fp32 parameters
            assert optimizer_bytes == HANDSHAKE + steps // 4 * dense_bytes(sizes, 4)


def test_accelerate_defaults_send_every_gradient_every_step(runs):
    steps, params = STEPS, sum(p.numel() for p in build_model(get_preset("tiny")).parameters())
    for rank in (0, 1):
        counted = read_wire(runs["plain"], rank)["counter"]
        assert sum(op["bytes"] for op in counted["backward"].values()) == steps * 4 * params
