"""examples/accelerate_train.py, the README's Accelerate recipe, under torchrun with 2 gloo
processes: a run checkpointed by `accelerator.save_state` and stopped there, then resumed by
`accelerator.load_state`, ends bit for bit where the uninterrupted run ends, on both ranks,
with rank 1's own optimizer state (it differs from rank 0's) restored; replicas identical."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train.shared import train_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_train.py"
# LoRDO syncs every 4 steps: the checkpoint at 6 falls between syncs, the run ends on one
RUNS = {"demo": ("8", "4"), "lordo": ("8", "6")}


def _torchrun(optimizer: str, out: Path, *flags: str) -> subprocess.Popen:
    steps, _ = RUNS[optimizer]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           "--optimizer", optimizer, "--steps", steps, "--out", str(out), *flags]
    return subprocess.Popen(cmd, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(*procs) -> None:
    for p in procs:
        text = p.communicate(timeout=240)[0]
        assert p.returncode == 0, text[-3000:]


@pytest.mark.parametrize("optimizer", list(RUNS))
def test_save_state_stop_load_state_ends_bit_identical(optimizer, tmp_path):
    save_at = RUNS[optimizer][1]
    whole, stopped, resumed = tmp_path / "whole", tmp_path / "stopped", tmp_path / "resumed"
    _finish(_torchrun(optimizer, whole, "--save-at", save_at),
            _torchrun(optimizer, stopped, "--save-at", save_at, "--stop-after-save"))
    assert not list(stopped.glob("params-rank*.pt"))                  # it stopped at the checkpoint
    _finish(_torchrun(optimizer, resumed, "--resume", str(stopped / f"step-{save_at}")))
    for rank in (0, 1):
        a, b = (torch.load(d / f"params-rank{rank}.pt") for d in (whole, resumed))
        assert torch.equal(a, b), f"rank {rank} resumed elsewhere"
    assert torch.equal(torch.load(whole / "params-rank0.pt"), torch.load(whole / "params-rank1.pt"))
    saved = torch.load(stopped / f"step-{save_at}" / "custom_checkpoint_0.pkl", weights_only=False)
    assert saved["world"] == 2
    first, second = saved["ranks"]
    assert _differs(first, second)                                    # rank 1's state is its own


def _differs(a, b) -> bool:
    if torch.is_tensor(a):
        return not torch.equal(a, b)
    if isinstance(a, dict):
        return any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return any(_differs(x, y) for x, y in zip(a, b))
    return False
