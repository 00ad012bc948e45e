"""examples/lightning_train.py, the README's Lightning recipe (ThinwireDDPStrategy), under
torchrun with 2 gloo processes, for DeMo (overlap=True: a step is in flight at every
checkpoint and at the end of fitting) and APMSqueeze:
- every collective counted: none in backward, the optimizer's bytes as its comm_stats counts
  them and, for APMSqueeze, as its wire format gives them by hand; one step() per 2
  micro-batches; the same run under plain `DDPStrategy()` all-reduces 4 bytes x every
  parameter every step in backward, so the 0 is not a counting mistake;
- a run resumed through `trainer.fit(ckpt_path=...)` from ModelCheckpoint's checkpoint at
  step 10 ends bit for bit where the uninterrupted run ends, on both ranks: DeMo's from a run
  SIGKILLed there, APMSqueeze's from its uninterrupted run's (one launch fewer); the checkpoint
  holds rank 1's own optimizer state (and DeMo's step in flight: not flushed for it), fitting
  ends with nothing in flight (flushed); replicas identical. Under plain `DDPStrategy()` the
  same resume gives rank 1 rank 0's APMSqueeze state (refused by it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.integrations.launch import differs, finish, read_wire, torchrun  # noqa: E402
from tests.optim.registry import APM_WARMUP, HANDSHAKE, dense_bytes, onebit_bytes  # noqa: E402
from tests.train.shared import train_env  # noqa: E402
from thinwire.optim.checkpoints import INFLIGHT_KEY  # noqa: E402
from thinwire.train.config import get_preset  # noqa: E402
from thinwire.train.model import build_model  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
STEPS, SAVE_AT = 20, 10
OPTIMIZERS = ("demo-overlap", "apmsqueeze")
KILLED = "demo-overlap"         # SIGKILLed at its checkpoint; the other resumes from its whole run's


def _torchrun(optimizer: str, out: Path, *flags: str) -> subprocess.Popen:
    return torchrun(EXAMPLE, "--optimizer", optimizer, "--steps", str(STEPS), "--save-at", str(SAVE_AT),
                    "--out", str(out), *flags, env=train_env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{optimizer: its run directories and "checkpoint", the one resumed}; "plain": plain
    DDPStrategy's counted run, and the log of its resume. Four launches, then three."""
    root = tmp_path_factory.mktemp("lightning")
    dirs = {name: {k: root / f"{name}-{k}" for k in ("whole", "resumed")} for name in OPTIMIZERS}
    killed = dirs[KILLED]["killed"] = root / f"{KILLED}-killed"
    for d in dirs.values():
        d["checkpoint"] = d.get("killed", d["whole"]) / f"step-{SAVE_AT}.ckpt"
    dirs["plain"] = {"whole": root / "plain", "resumed": root / "plain-resumed"}
    first = [(_torchrun(n, dirs[n]["whole"], "--count"), True) for n in OPTIMIZERS]
    first.append((_torchrun(KILLED, killed, "--kill-after-save"), False))
    first.append((_torchrun("apmsqueeze", dirs["plain"]["whole"], "--plain-ddp", "--count"), True))
    for proc, ok in first:
        finish(proc, ok)
    second = [(_torchrun(n, dirs[n]["resumed"], "--resume", str(dirs[n]["checkpoint"])), True) for n in OPTIMIZERS]
    second.append((_torchrun("apmsqueeze", dirs["plain"]["resumed"], "--plain-ddp", "--resume",
                             str(dirs["plain"]["whole"] / f"step-{SAVE_AT}.ckpt")), False))
    logs = [finish(proc, ok) for proc, ok in second]
    dirs["plain"]["resume_log"] = logs[-1]
    return dirs


def _sizes() -> list[int]:
    return [p.numel() for p in build_model(get_preset("tiny")).parameters()]


def _bytes(counted: dict, label: str) -> int:
    return sum(op["bytes"] for op in counted.get(label, {}).values())


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_no_gradient_bytes_and_the_optimizer_sends_its_wire_format(runs, optimizer):
    for rank in (0, 1):
        wire = read_wire(runs[optimizer]["whole"], rank)
        counted = wire["counter"]
        assert "backward" not in counted                              # not one collective in backward
        assert counted["optimizer_steps"] == STEPS                    # one step() per 2 micro-batches
        assert not wire["in_flight_after_fit"]                        # the strategy flushed the last step
        assert _bytes(counted, "optimizer") == wire["comm_stats"]["totals"]["payload_bytes"]
        if optimizer == "apmsqueeze":    # handshake, dense fp32 warmup (+ trailer), then 1-bit phases
            sizes = _sizes()
            expected = HANDSHAKE + APM_WARMUP * dense_bytes(sizes, 4) + (STEPS - APM_WARMUP) * onebit_bytes(2, sizes)
            assert _bytes(counted, "optimizer") == expected


def test_plain_ddp_strategy_sends_every_gradient_every_step(runs):
    params = sum(_sizes())
    for rank in (0, 1):
        counted = read_wire(runs["plain"]["whole"], rank)["counter"]
        assert _bytes(counted, "backward") == STEPS * 4 * params


def test_killed_at_the_checkpoint_it_is_resumed_from(runs):
    killed = runs[KILLED]["killed"]
    assert runs[KILLED]["checkpoint"].parent == killed
    assert not list(killed.glob("params-rank*.pt"))                    # it died at the checkpoint
    assert not (killed / f"step-{STEPS}.ckpt").exists()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resumed_by_fit_from_the_checkpoint_ends_bit_identical(runs, optimizer):
    d = runs[optimizer]
    for rank in (0, 1):
        a, b = (torch.load(d[k] / f"params-rank{rank}.pt") for k in ("whole", "resumed"))
        assert torch.equal(a, b), f"rank {rank} resumed elsewhere"
    assert torch.equal(torch.load(d["whole"] / "params-rank0.pt"), torch.load(d["whole"] / "params-rank1.pt"))
    saved = torch.load(d["checkpoint"], weights_only=False)["optimizer_states"]
    assert len(saved) == 1 and saved[0]["world"] == 2
    first, second = saved[0]["ranks"]
    assert differs(first, second)                                    # rank 1's state is its own
    assert (INFLIGHT_KEY in first) == optimizer.endswith("overlap")   # a checkpoint observes, never flushes


def test_plain_ddp_strategy_resumes_rank_1_with_rank_0s_state(runs):
    log = runs["plain"]["resume_log"]
    assert "holds the error-feedback buffers of rank 0 of 2, but this is rank 1" in log, log[-3000:]


def test_strategy_refuses_gradient_communication_and_untested_lightning():
    from thinwire.integrations.lightning import ThinwireDDPStrategy, check_lightning_version

    for kwargs in ({"ddp_comm_hook": lambda state, bucket: None}, {"model_averaging_period": 4},
                   {"broadcast_buffers": True}, {"forward_sync_buffers": True}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ThinwireDDPStrategy(**kwargs)
    for version in ("2.3.3", "2.7.0", "3.0.0", "dev"):
        with pytest.raises(RuntimeError, match="lightning >= 2.4, < 2.7"):
            check_lightning_version(version)
    check_lightning_version("2.4.0")
