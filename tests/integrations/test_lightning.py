"""examples/lightning_train.py, the README's Lightning recipe (ThinwireDDPStrategy), under
torchrun with 2 gloo processes, for DeMo (overlap=True: a step is in flight at every
checkpoint and at the end of fitting) and APMSqueeze:
- every collective counted: none in backward, the optimizer's bytes as its comm_stats counts
  them and, for APMSqueeze, as its wire format gives them by hand; one step() per 2
  micro-batches; the same run under plain `DDPStrategy()` all-reduces 4 bytes x every
  parameter every step in backward, so the 0 is not a counting mistake;
- DeMo's run killed in the middle of writing checkpoint 10 (rank 0 SIGKILLed half way through
  the file, after the all-gather) and resumed in place by `trainer.fit(ckpt_path="last")`
  takes checkpoint 5, says it skipped the half-written step-10.ckpt.tmp, and ends bit for bit
  where the uninterrupted run ends, on both ranks; its comm_stats count what it handed to
  torch.distributed after the resume (`CollectiveCounter`), the re-sent step in flight
  included; APMSqueeze's run resumed from its uninterrupted run's step-10.ckpt ends bit for
  bit too (one launch fewer); a checkpoint holds rank 1's own optimizer state (and DeMo's
  step in flight: not flushed for it), fitting ends with nothing in flight (flushed);
  replicas identical. Under plain `DDPStrategy()` the same resume gives rank 1 rank 0's
  APMSqueeze state (refused by it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.integrations.launch import Forked, differs, finish, preloaded, read_wire, torchrun  # noqa: E402
from tests.optim.registry import APM_WARMUP, HANDSHAKE, dense_bytes, onebit_bytes  # noqa: E402
from tests.train.shared import train_env  # noqa: E402
from thinwire.optim.checkpoints import INFLIGHT_KEY  # noqa: E402
from thinwire.train.config import get_preset  # noqa: E402
from thinwire.train.model import build_model  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
STEPS, SAVE_AT, KILL_IN = 20, 5, 10
OPTIMIZERS = ("demo-overlap", "apmsqueeze")
KILLED = "demo-overlap"         # killed while writing checkpoint KILL_IN; the other resumes from its whole run's


def _torchrun(env: dict, optimizer: str, out: Path, *flags: str) -> Forked:
    return torchrun(EXAMPLE, "--optimizer", optimizer, "--steps", str(STEPS), "--save-at", str(SAVE_AT),
                    "--out", str(out), *flags, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with preloaded(EXAMPLE, train_env()) as env:      # Lightning imported once, not by each of 14 workers
        return _runs(tmp_path_factory, env)


def _runs(tmp_path_factory, env: dict) -> dict:
    """{optimizer: its run directories and "checkpoint", one of its whole run's}; KILLED's
    "resumed" is its killed run's directory, resumed in place, with "after_kill" (what the
    kill left there) and "resume_log"; "plain": plain DDPStrategy's counted run, and the log
    of its resume. Four launches, then three."""
    root = tmp_path_factory.mktemp("lightning")
    dirs = {name: {k: root / f"{name}-{k}" for k in ("whole", "resumed")} for name in OPTIMIZERS}
    for d in dirs.values():
        d["checkpoint"] = d["whole"] / f"step-{KILL_IN}.ckpt"
    killed = dirs[KILLED]["resumed"]
    dirs["plain"] = {"whole": root / "plain", "resumed": root / "plain-resumed"}
    first = [(_torchrun(env, n, dirs[n]["whole"], "--count"), True) for n in OPTIMIZERS]
    first.append((_torchrun(env, KILLED, killed, "--kill-in-save", str(KILL_IN)), False))
    first.append((_torchrun(env, "apmsqueeze", dirs["plain"]["whole"], "--plain-ddp", "--count"), True))
    for proc, ok in first:
        finish(proc, ok)
    dirs[KILLED]["after_kill"] = sorted(p.name for p in killed.iterdir())
    second = [(_torchrun(env, KILLED, killed, "--resume", "last", "--count"), True),
              (_torchrun(env, "apmsqueeze", dirs["apmsqueeze"]["resumed"], "--resume", str(dirs["apmsqueeze"]["checkpoint"])),
               True),
              (_torchrun(env, "apmsqueeze", dirs["plain"]["resumed"], "--plain-ddp", "--resume",
                         str(dirs["plain"]["whole"] / f"step-{KILL_IN}.ckpt")), False)]
    logs = [finish(proc, ok) for proc, ok in second]
    dirs[KILLED]["resume_log"], dirs["plain"]["resume_log"] = logs[0], logs[-1]
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


def test_killed_mid_write_resumes_from_the_previous_checkpoint_naming_the_skipped_one(runs):
    d = runs[KILLED]
    left = d["after_kill"]                                   # rank 0 died half way through step-10.ckpt
    assert f"step-{KILL_IN}.ckpt.tmp" in left and f"step-{KILL_IN}.ckpt" not in left, left
    assert {f"step-{SAVE_AT}.ckpt", "last.ckpt"} <= set(left) and not any(n.startswith("params") for n in left)
    assert (f"thinwire: skipped incomplete checkpoint step-{KILL_IN}.ckpt.tmp (a write that never finished: never "
            f"renamed to its .ckpt); resuming from last.ckpt (step {SAVE_AT})") in d["resume_log"], d["resume_log"][-3000:]
    assert not list(d["resumed"].glob("*.tmp"))               # the resumed run wrote step-10.ckpt whole


def test_comm_stats_after_an_overlap_resume_count_what_was_handed_to_torch_distributed(runs):
    """The resumed run sends the step in flight at checkpoint 5 again: comm_stats count it (the
    bytes CollectiveCounter saw handed over since the resume), so they exceed the whole run's."""
    d = runs[KILLED]
    for rank in (0, 1):
        wire, whole = read_wire(d["resumed"], rank), read_wire(d["whole"], rank)
        start, end = (wire[k]["totals"]["payload_bytes"] for k in ("comm_stats_at_start", "comm_stats"))
        assert start > 0 and end - start == _bytes(wire["counter"], "optimizer")
        assert end > whole["comm_stats"]["totals"]["payload_bytes"]


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


def test_strategy_refuses_gradient_communication_unused_parameter_maps_and_untested_lightning():
    from thinwire.integrations.lightning import ThinwireDDPStrategy, check_lightning_version

    for kwargs in ({"ddp_comm_hook": lambda state, bucket: None}, {"model_averaging_period": 4},
                   {"broadcast_buffers": True}, {"forward_sync_buffers": True}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ThinwireDDPStrategy(**kwargs)
    with pytest.raises(ValueError, match="find_unused_parameters=False"):
        ThinwireDDPStrategy(find_unused_parameters=True)
    for version in ("2.3.3", "2.7.0", "3.0.0", "dev"):
        with pytest.raises(RuntimeError, match="lightning >= 2.4, < 2.7"):
            check_lightning_version(version)
    check_lightning_version("2.4.0")
