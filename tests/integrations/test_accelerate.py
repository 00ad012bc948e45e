"""examples/accelerate_train.py, the README's Accelerate recipe, under torchrun with 2 gloo
processes:
- every collective counted (`CollectiveCounter`): none in backward, the optimizer's bytes as
  its comm_stats counts them and, for LoRDO, as its wire format gives them by hand; the same
  run under Accelerate's defaults (`--plain-ddp`) all-reduces every gradient every step, so
  the 0 is not a counting mistake;
- a run resumed by `accelerator.load_state` from `accelerator.save_state`'s checkpoint ends bit
  for bit where the uninterrupted run ends, on both ranks, with rank 1's own optimizer state (it
  differs from rank 0's) restored; replicas identical. DeMo's checkpoint is a run's SIGKILLed
  there, LoRDO's its uninterrupted run's (one launch fewer)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.integrations.launch import differs, finish, read_wire, torchrun
from tests.optim.registry import HANDSHAKE, dense_bytes
from tests.train.shared import train_env
from thinwire.train.config import get_preset
from thinwire.train.model import build_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_train.py"
# (steps, checkpoint at). LoRDO syncs every 4 steps: the checkpoint at 10 falls between syncs, the run ends on one
RUNS = {"demo": (20, 10), "lordo": (20, 10)}
KILLED = "demo"                 # SIGKILLed at its checkpoint; LoRDO resumes from its whole run's


def _torchrun(optimizer: str, out: Path, *flags: str) -> subprocess.Popen:
    return torchrun(EXAMPLE, "--optimizer", optimizer, "--steps", str(RUNS[optimizer][0]), "--out", str(out),
                    *flags, env=train_env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{optimizer: its run directories and "checkpoint", the one resumed}, and the plain-DDP
    baseline: four launches, then two."""
    root = tmp_path_factory.mktemp("accelerate")
    dirs = {name: {k: root / f"{name}-{k}" for k in ("whole", "resumed")} for name in RUNS}
    killed = dirs[KILLED]["killed"] = root / f"{KILLED}-killed"
    for n, d in dirs.items():
        d["checkpoint"] = d.get("killed", d["whole"]) / f"step-{RUNS[n][1]}"
    first = [(_torchrun(n, d["whole"], "--count", "--save-at", str(RUNS[n][1])), True) for n, d in dirs.items()]
    first.append((_torchrun(KILLED, killed, "--save-at", str(RUNS[KILLED][1]), "--kill-after-save"), False))
    dirs["plain"] = root / "plain"
    first.append((_torchrun("demo", dirs["plain"], "--plain-ddp", "--count"), True))
    for proc, ok in first:
        finish(proc, ok)
    second = [_torchrun(n, dirs[n]["resumed"], "--resume", str(dirs[n]["checkpoint"])) for n in RUNS]
    for proc in second:
        finish(proc)
    return dirs


def test_killed_at_the_checkpoint_it_is_resumed_from(runs):
    killed = runs[KILLED]["killed"]
    assert runs[KILLED]["checkpoint"].parent == killed
    assert not list(killed.glob("params-rank*.pt"))                    # it died at the checkpoint


@pytest.mark.parametrize("optimizer", list(RUNS))
def test_resumed_by_load_state_ends_bit_identical(runs, optimizer):
    d = runs[optimizer]
    for rank in (0, 1):
        a, b = (torch.load(d[k] / f"params-rank{rank}.pt") for k in ("whole", "resumed"))
        assert torch.equal(a, b), f"rank {rank} resumed elsewhere"
    assert torch.equal(torch.load(d["whole"] / "params-rank0.pt"), torch.load(d["whole"] / "params-rank1.pt"))
    saved = torch.load(d["checkpoint"] / "custom_checkpoint_0.pkl", weights_only=False)
    assert saved["world"] == 2
    first, second = saved["ranks"]
    assert differs(first, second)                                    # rank 1's state is its own


@pytest.mark.parametrize("optimizer", list(RUNS))
def test_no_gradient_bytes_and_the_optimizer_sends_its_wire_format(runs, optimizer):
    steps = RUNS[optimizer][0]
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
    steps, params = RUNS["demo"][0], sum(p.numel() for p in build_model(get_preset("tiny")).parameters())
    for rank in (0, 1):
        counted = read_wire(runs["plain"], rank)["counter"]
        assert sum(op["bytes"] for op in counted["backward"].values()) == steps * 4 * params
