"""Elastic resume (issue 27): a flat `thinwire train` run resumes from a checkpoint written at
another number of workers. Real gloo processes through the harness: DeMo written by 2
workers resumed by 3 (conftest's run never killed, its step-4 checkpoint), LoRDO written by 3
resumed by 2 (its replicas drift between syncs, so its per-rank parameters are mapped too).
The resumed run finishes with identical replicas, its log announces the world change and
reports the time to recover, and each new rank's loaded state is the interval rule applied to
the old ranks' saved states, computed here from the checkpoint's own bytes. A checkpoint of
another optimizer or learning rate is still refused, naming what differs."""

from __future__ import annotations

import io
import json
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tests.dist import run_workers
from tests.train.shared import TRAIN, Forked, start, wait
from thinwire.train.checkpoint import checkpoint_root, latest
from thinwire.train.config import get_preset

CASES = {"demo": (2, 3, 8), "lordo": (3, 2, 9)}       # optimizer: (old workers, new workers, steps)


def _train(out: Path, optimizer: str, workers: int, steps: int, die: str | None = None) -> Forked:
    return start([sys.executable, "-m", "thinwire", "train", "--optimizer", optimizer, *TRAIN, "--workers",
                  str(workers), "--steps", str(steps), "--out", str(out), "--checkpoint-every", "4"], die)


@pytest.fixture(scope="module")
def resumed(demo_never_killed, tmp_path_factory):
    """Per optimizer: (the out directory resumed at the new world size, its output, a copy of
    the step-4 checkpoint it resumed from, written by the old world). DeMo's resume runs beside
    LoRDO's killed run."""
    root = tmp_path_factory.mktemp("elastic")
    outs, saved = {name: root / name for name in CASES}, {name: root / f"{name}-step-000004" for name in CASES}

    def resume(name: str) -> Forked:
        _, new, steps = CASES[name]
        assert latest(checkpoint_root(outs[name])).name == "step-000004"
        shutil.copytree(checkpoint_root(outs[name]) / "step-000004", saved[name])
        return _train(outs[name], name, new, steps)

    shutil.copytree(demo_never_killed, outs["demo"])             # 2 workers, 8 steps: checkpoints 4 and 8
    shutil.rmtree(checkpoint_root(outs["demo"]) / "step-000008")
    old, _, steps = CASES["lordo"]
    killed = _train(outs["lordo"], "lordo", old, steps, die="1:5")   # killed as it starts step 5: step 4 is the last
    again = {"demo": resume("demo")}
    first = wait(killed)
    assert first.returncode == 1, first.stdout[-3000:]
    again["lordo"] = resume("lordo")
    runs = {}
    for name, proc in again.items():
        done = wait(proc)
        assert done.returncode == 0, done.stdout[-3000:]
        runs[name] = (outs[name], done.stdout, saved[name])
    return runs


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", CASES)
def test_resumed_run_finishes_with_identical_replicas_and_reports_time_to_recover(name, resumed):
    old, new, steps = CASES[name]
    out, text, _ = resumed[name]
    assert latest(checkpoint_root(out)).name == f"step-{steps:06d}"
    recs = _records(out, name)
    assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(1, steps + 1))   # none twice, none missing
    final = recs[-1]
    assert final["kind"] == "final" and final["replicas_identical"] is True
    assert (f"thinwire: resuming step-000004 of a {old}-worker {name} run on {new} workers: per-rank optimizer "
            f"state mapped by the interval rule") in text, text
    assert "resuming " + name + " from" not in text                     # one line: the elastic one
    (rec,) = [r for r in recs if r["kind"] == "resume"]
    assert (rec["step"], rec["checkpoint"], rec["old_world"], rec["world"]) == (4, "step-000004", old, new)
    assert 0 < rec["load_s"] < rec["time_to_recover_s"] < 240
    assert recs.index(rec) == next(i for i, r in enumerate(recs) if r["kind"] == "step" and r["step"] == 5) - 1
    row = json.loads((out / "summary.json").read_text())["runs"][0]
    assert row["resumes"] == [{k: rec[k] for k in ("step", "checkpoint", "old_world", "world", "load_s",
                                                   "time_to_recover_s")}]


def _weights(old: int, new: int) -> list[list[Fraction]]:
    """The interval rule, from its definition: A[j][i] = new x |[j/new, (j+1)/new) n [i/old, (i+1)/old)|."""
    def overlap(j: int, i: int) -> Fraction:
        lo = max(Fraction(j, new), Fraction(i, old))
        hi = min(Fraction(j + 1, new), Fraction(i + 1, old))
        return max(hi - lo, Fraction(0))
    return [[new * overlap(j, i) for i in range(old)] for j in range(new)]


def _old_blobs(path: Path, tmp_path: Path) -> list[dict]:
    """Every old rank's "rank{i}" blob, read from the checkpoint in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(path), str(tmp_path / "all.pt"))
    state = torch.load(tmp_path / "all.pt", weights_only=False)
    blobs = []
    while f"rank{len(blobs)}" in state:
        buf = state[f"rank{len(blobs)}"]
        buf.seek(0)
        blobs.append(torch.load(buf, weights_only=False))
    return blobs


def _load_on_new_world(rank: int, world: int, path: str, name: str, steps: int) -> dict:
    """What the harness's worker does before its first step after resume: build, then checkpoint.load."""
    from thinwire.train.checkpoint import load
    from thinwire.train.model import build_model
    from thinwire.train.optimizers import get_optimizer
    from thinwire.train.worker import lr_factor
    cfg = get_preset("tiny", steps=steps, eval_every=4, eval_rows=16, workers=world, sync_every=3)
    built = get_optimizer(name).build(build_model(cfg), cfg, get_optimizer(name).lr_for("tiny"))
    sched = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda s: lr_factor(s, cfg))
    step = load(path, built.model, built, sched, rank)
    return {"step": step, "epoch": sched.last_epoch, "rng": torch.get_rng_state(),
            "optimizer": built.optimizer.state_dict(),
            "params": {n: p.detach().clone() for n, p in built.model.named_parameters()}}


def _mixed(values: list[torch.Tensor], row: list[Fraction]) -> torch.Tensor:
    return sum(float(w) * v.double() for v, w in zip(values, row) if w).to(values[0].dtype)


@pytest.mark.parametrize("name", CASES)
def test_each_new_rank_loads_the_interval_rule_of_the_old_ranks_states(name, resumed, tmp_path):
    old, new, steps = CASES[name]
    saved = resumed[name][2]
    blobs = _old_blobs(saved, tmp_path)
    assert len(blobs) == old
    loaded = run_workers(_load_on_new_world, new, args=(str(saved), name, steps))
    weights = _weights(old, new)
    assert weights[0] == ([1, 0] if old == 2 else [Fraction(2, 3), Fraction(1, 3), 0])
    seed = get_preset("tiny").seed
    for j, got in enumerate(loaded):
        assert got["step"] == 4 and got["epoch"] == 4                     # the schedule carries over
        # RNG: old rank j's where there was one, else seeded from (seed, step, rank) as documented
        want_rng = (blobs[j]["rng"]["cpu"] if j < old
                    else torch.Generator().manual_seed((seed * 1_000_003 + 4) * 65_537 + j).get_state())
        assert torch.equal(got["rng"], want_rng)
        if name == "demo":                                 # DeMo's momentum, the error feedback: per rank
            for k, state in got["optimizer"]["state"].items():
                want = _mixed([b["optimizer"]["state"][k]["momentum"] for b in blobs], weights[j])
                torch.testing.assert_close(state["momentum"], want, rtol=1e-6, atol=1e-7)
        else:                                              # LoRDO: each rank's own parameters (replicas drift)
            assert any(not torch.equal(blobs[0]["params"][n], blobs[1]["params"][n]) for n in blobs[0]["params"])
            for n, p in got["params"].items():
                torch.testing.assert_close(p, _mixed([b["params"][n] for b in blobs], weights[j]),
                                           rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flags, says", [
    (["--optimizer", "lordo"], "optimizer: checkpoint 'demo', this run 'lordo'"),
    (["--optimizer", "demo", "--lr", "1e-3"], "lr: checkpoint 0.003, this run 0.001"),
])
def test_another_optimizer_or_lr_is_still_refused_at_another_world_size(flags, says, demo_never_killed, tmp_path,
                                                                        capsys):
    from thinwire.train.cli import main
    out = tmp_path / "run"
    shutil.copytree(demo_never_killed, out)
    with pytest.raises(SystemExit) as exc:
        main(["train", *flags, *TRAIN, "--workers", "3", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err and "resuming" not in err, err
    assert "world size" not in err                                        # the world size is not what differs
