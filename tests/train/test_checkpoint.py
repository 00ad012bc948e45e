"""Harness checkpoints (train/checkpoint.py): per-rank optimizer state survives DCP, a
resumed run is bit-identical to an uninterrupted one, a truncated or foreign checkpoint is
a clear error before any step, and the previous checkpoint still loads."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.dist import run_workers
from thinwire.train.checkpoint import (CheckpointError, check, check_resumable, checkpoint_root, complete,
                                       expected_meta, latest, read_model, skipped)
from thinwire.train.config import get_preset
from thinwire.train.run import compare

TINY = dict(steps=8, eval_every=4, eval_rows=16, workers=2, sync_every=3)      # shared.TRAIN's flags


def _apm_round_trip(rank: int, world: int, root: str):
    from thinwire.train.checkpoint import load, save
    from thinwire.train.model import build_model
    from thinwire.train.optimizers import get_optimizer
    cfg = get_preset("tiny", apmsqueeze_compressed_after=0.5, steps=10)       # 5 dense warmup steps, then 1-bit
    built = get_optimizer("apmsqueeze").build(build_model(cfg), cfg, 3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda s: 1.0)
    torch.manual_seed(100 + rank)                      # every rank its own gradients: errors differ
    for _ in range(7):                                 # two 1-bit steps: the error buffers are set
        for p in built.model.parameters():
            p.grad = torch.randn_like(p)
        built.optimizer.step()
        sched.step()
    before = built.optimizer.worker_error.clone(), built.optimizer.server_error.clone()
    meta = expected_meta(cfg, "apmsqueeze", 3e-3, world, built.model)
    save(root, 7, built.model, built, sched, meta, rank)
    fresh = get_optimizer("apmsqueeze").build(build_model(replace(cfg, seed=7)), cfg, 3e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(fresh.optimizer, lambda s: 1.0)
    step = load(latest(root), fresh.model, fresh, sched2, rank)
    after = fresh.optimizer.worker_error, fresh.optimizer.server_error
    same_params = all(torch.equal(a, b) for a, b in zip(built.model.parameters(), fresh.model.parameters()))
    return step, before, [t.clone() for t in after], same_params, sched2.last_epoch


def test_every_ranks_error_feedback_survives_a_dcp_round_trip(tmp_path):
    """The DeepSpeed 1-bit Adam bug: DCP keeps one copy of a value saved under one key on every
    rank. Per-rank keys keep rank 1's APMSqueeze error buffers as rank 1 wrote them."""
    results = run_workers(_apm_round_trip, 2, args=(str(tmp_path),))
    for step, before, after, same_params, epoch in results:
        assert step == 7 and same_params and epoch == 7
        assert all(torch.equal(b, a) for b, a in zip(before, after))
    (w0, s0), (w1, s1) = results[0][1], results[1][1]
    assert w1.abs().sum() > 0 and not torch.equal(w0, w1)     # rank 1's own errors, not rank 0's
    assert not torch.equal(s0, s1)


def _run(out: Path, every: int = 4, **over) -> None:
    cfg = get_preset("tiny", **{**TINY, **over})
    compare(cfg, ["demo"], out_dir=str(out), quiet=True, show=False, checkpoint=True, checkpoint_every=every)


@pytest.fixture(scope="module")
def interrupted(demo_never_killed, tmp_path_factory):
    """A run written to the end (`thinwire train` of the same run as _run's, shared with
    test_faults.py: copied before anything changes it), and the same run resumed from its
    step-4 checkpoint."""
    whole, resumed = demo_never_killed, tmp_path_factory.mktemp("ckpt") / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(checkpoint_root(resumed) / "step-000008")
    _run(resumed)
    return whole, resumed


def test_resume_continues_bit_for_bit(interrupted, capsys):
    whole, resumed = interrupted
    a = read_model(checkpoint_root(whole) / "step-000008")
    b = read_model(checkpoint_root(resumed) / "step-000008")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    logs = [(p / "demo.jsonl").read_text() for p in (whole, resumed)]
    strip = lambda text: [{k: v for k, v in json.loads(line).items() if k != "adamw_probe_s"}   # timings
                          for line in text.splitlines()
                          if '"step_s"' not in line and '"final"' not in line and '"resume"' not in line]
    assert [line.split('"step_s"')[0] for line in logs[0].splitlines() if '"kind": "step"' in line] == \
           [line.split('"step_s"')[0] for line in logs[1].splitlines() if '"kind": "step"' in line]
    assert strip(logs[0]) == strip(logs[1])                        # evals equal too, no duplicate steps


def test_keeps_the_two_newest_complete_checkpoints(interrupted):
    whole, _ = interrupted
    assert [p.name for p in complete(checkpoint_root(whole))] == ["step-000004", "step-000008"]
    assert not list(checkpoint_root(whole).glob("*.tmp"))


def test_truncated_checkpoint_is_a_clear_error_and_the_previous_one_loads(interrupted, tmp_path, capsys):
    whole, _ = interrupted
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    last = checkpoint_root(out) / "step-000008"
    shard = last / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step-000008 is corrupt: __1_0.distcp is 100 bytes.*previous "
                                              r"checkpoint .*step-000004"):
        _run(out)
    shutil.rmtree(last)                                     # as the error says: the previous one then loads
    _run(out)
    assert "resuming demo from" in capsys.readouterr().err
    a, b = read_model(checkpoint_root(whole) / "step-000008"), read_model(last)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_names_each_incomplete_checkpoint_it_skips(interrupted, tmp_path, capsys):
    """Folders `latest` leaves out, newer than what it takes: one line on stderr says which,
    why, and the step taken instead (a .tmp never renamed: test_faults.py's killed run)."""
    whole, _ = interrupted
    root = checkpoint_root(tmp_path)
    shutil.copytree(checkpoint_root(whole), root)
    (root / "step-000008" / "thinwire.json").unlink()             # a folder without its metadata
    shutil.copytree(root / "step-000004", root / "step-000012.tmp")
    (root / "step-000012.tmp" / "thinwire.json").unlink()         # a write that never finished
    (root / "step-000002.tmp").mkdir()                            # older than what is taken: not named
    cfg = get_preset("tiny", **TINY)
    check_resumable(tmp_path, cfg, "demo", 3e-3, 2)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("thinwire: skipped incomplete checkpoint step-000008 (no thinwire.json: its metadata was "
                        "never written or was removed); step-000012.tmp (no thinwire.json, 3 file(s) written: a rank "
                        "stopped while writing it); resuming from step-000004 (step 4)")
    assert "resuming demo from" in lines[1] and "(step 4 of 8)" in lines[1]
    check_resumable(tmp_path, cfg, "demo", 3e-3, 2, announce=False)            # ranks other than 0 say nothing
    assert capsys.readouterr().err == ""
    shutil.rmtree(root / "step-000004")
    assert skipped(root).endswith("; no complete one: starting afresh")


def test_incompatible_checkpoint_names_what_differs(interrupted):
    whole, _ = interrupted
    path = latest(checkpoint_root(whole))
    cfg = get_preset("tiny", **TINY)
    check(path, expected_meta(cfg, "demo", 3e-3, 2))
    with pytest.raises(CheckpointError, match=r"optimizer: checkpoint 'demo', this run 'lordo'"):
        check(path, expected_meta(cfg, "lordo", 3e-3, 2))
    assert check(path, expected_meta(replace(cfg, workers=3), "demo", 3e-3, 3))["world"] == 2   # elastic: resumed
    with pytest.raises(CheckpointError, match=r"sites: checkpoint 0, this run 3 \(a flat run and a --sites run do "
                                              r"not resume each other\)"):
        check(path, expected_meta(replace(cfg, workers=3, sites=3), "demo", 3e-3, 3))
    with pytest.raises(CheckpointError, match=r"n_embd: checkpoint 64, this run 128"):
        check(path, expected_meta(replace(cfg, n_embd=128), "demo", 3e-3, 2))
    check(path, expected_meta(replace(cfg, eval_every=2), "demo", 3e-3, 2))    # evaluation may change


def test_a_checkpoint_older_than_a_config_field_resumes_with_its_default(interrupted, tmp_path):
    """A config field added after a checkpoint was written (its thinwire.json lacks it): that run
    had the field's default, so a run at the default resumes it and any other value is refused."""
    whole, _ = interrupted
    older = tmp_path / "older"
    shutil.copytree(latest(checkpoint_root(whole)), older)
    meta = json.loads((older / "thinwire.json").read_text())
    del meta["config"]["sparseloco_topk"]
    (older / "thinwire.json").write_text(json.dumps(meta))
    cfg = get_preset("tiny", **TINY)
    assert check(older, expected_meta(cfg, "demo", 3e-3, 2))["step"] == meta["step"]
    with pytest.raises(CheckpointError, match=r"sparseloco_topk: checkpoint 128, this run 64"):
        check(older, expected_meta(cfg.with_settings(sparseloco_topk=64), "demo", 3e-3, 2))


def test_a_checkpoint_from_before_the_settings_rename_resumes(interrupted, tmp_path):
    """A checkpoint written when DeMo's top-k was the config's `topk` (now `demo_topk`,
    config.RENAMED) is the same run: it resumes, and another top-k is refused by its new name."""
    whole, _ = interrupted
    older = tmp_path / "older"
    shutil.copytree(latest(checkpoint_root(whole)), older)
    meta = json.loads((older / "thinwire.json").read_text())
    meta["config"]["topk"] = meta["config"].pop("demo_topk")
    (older / "thinwire.json").write_text(json.dumps(meta))
    cfg = get_preset("tiny", **TINY)
    assert check(older, expected_meta(cfg, "demo", 3e-3, 2))["step"] == meta["step"]
    with pytest.raises(CheckpointError, match=r"demo_topk: checkpoint 32, this run 31"):
        check(older, expected_meta(cfg.with_settings(demo_topk=31), "demo", 3e-3, 2))


def test_cli_refuses_a_foreign_checkpoint_before_any_worker_starts(interrupted, tmp_path, capsys):
    from thinwire.train.cli import main
    whole, _ = interrupted
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--optimizer", "lordo", "--preset", "tiny", "--steps", "8", "--eval-every", "4",
              "--eval-rows", "16", "--workers", "2", "--sync-every", "3", "--out", str(out), "--quiet"])
    assert exc.value.code == 2
    assert "optimizer: checkpoint 'demo', this run 'lordo'" in capsys.readouterr().err


SITES = ["demo", "lordo", "adamw"]
SITES_CFG = get_preset("tiny", **{**TINY, **dict(steps=4, eval_every=2, workers=4, sites=2, sync_every=3)})


def _train_under_sites(rank: int, world: int, name: str, out: Path) -> None:
    """What compare(SITES_CFG, [name], out, checkpoint=True, checkpoint_every=2) runs on a worker."""
    from thinwire.train.config import RunOptions
    from thinwire.train.optimizers import get_optimizer
    from thinwire.train.worker import train_worker
    train_worker(rank, world, SITES_CFG, name, get_optimizer(name).lr_for(SITES_CFG.name), str(out / f"{name}.jsonl"),
                 RunOptions(out_dir=str(out), quiet=True, checkpoint=True, checkpoint_every=2))


def _resume_each_under_sites(rank: int, world: int, root: str) -> None:
    """Every optimizer in SITES in turn in one group of 4 processes (spawning 4 workers twice
    per optimizer was most of these cases' time): the whole run, then rank 0 copies it without
    its last checkpoint, then the copy resumes."""
    import torch.distributed as dist
    for name in SITES:
        whole, resumed = Path(root, name, "whole"), Path(root, name, "resumed")
        if rank == 0:
            whole.mkdir(parents=True)
        dist.barrier()
        _train_under_sites(rank, world, name, whole)
        dist.barrier()                                      # every rank's shards written before the copy
        if rank == 0:
            shutil.copytree(whole, resumed)
            shutil.rmtree(checkpoint_root(resumed) / "step-000004")
        dist.barrier()
        assert latest(checkpoint_root(resumed)).name == "step-000002"
        _train_under_sites(rank, world, name, resumed)


@pytest.fixture(scope="module")
def under_sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("sites")
    run_workers(_resume_each_under_sites, 4, args=(str(root),))
    return root


@pytest.mark.parametrize("optimizer", SITES)
def test_resume_under_sites_is_bit_identical(optimizer, under_sites):
    """--sites 2 with 2 ranks per site: the model is saved as FSDP2 shards (HSDP AdamW's
    state too), LoRDO's per-rank replicas as each rank's local shards."""
    a = read_model(checkpoint_root(under_sites / optimizer / "whole") / "step-000004")
    b = read_model(checkpoint_root(under_sites / optimizer / "resumed") / "step-000004")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)


def _trajectory(path: Path, name: str) -> list:
    import json
    recs = [json.loads(line) for line in (path / f"{name}.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r.get("loss"), r.get("val_loss")) for r in recs if r["kind"] != "final"]


def test_checkpoints_do_not_change_the_run(interrupted, tmp_path):
    """Writing checkpoints (state dicts, DCP) leaves the trajectory alone: the same losses and
    validation losses as a run that writes none."""
    whole, _ = interrupted
    compare(get_preset("tiny", **TINY), ["demo"], out_dir=str(tmp_path), quiet=True, show=False)
    assert _trajectory(whole, "demo") == _trajectory(tmp_path, "demo")


def test_checkpoints_leave_an_exchange_in_flight_alone(tmp_path):
    """With an exchange in flight at every checkpoint (DeMo, overlap and the lookahead: the
    parameters stand moved), checkpointing every 2 steps gives exactly the losses and
    validation losses of a run that writes none."""
    cfg = get_preset("tiny", **TINY)
    compare(cfg, ["demo-lookahead"], out_dir=str(tmp_path / "plain"), quiet=True, show=False)
    compare(cfg, ["demo-lookahead"], out_dir=str(tmp_path / "checkpointed"), quiet=True, show=False,
            checkpoint=True, checkpoint_every=2)
    assert _trajectory(tmp_path / "plain", "demo-lookahead") == _trajectory(tmp_path / "checkpointed", "demo-lookahead")
