"""Presets, data sharding and splits, the model, the LR schedule and the report arithmetic."""

import math

import pytest
import torch

from thinwire.train.config import PRESETS, get_preset, parse_link
from thinwire.train.settings import DeMoSettings
from thinwire.train.data import load_corpus, stdlib_files, train_batch
from thinwire.train.model import build_model
from thinwire.train.optimizers import OPTIMIZERS, get_optimizer
from thinwire.train.report import summarize, time_to_target
from thinwire.train.worker import lr_factor


def test_presets_and_overrides():
    assert set(PRESETS) == {"tiny", "small", "base", "wan", "sites"}
    cfg = get_preset("tiny", steps=7, lr=None)
    assert cfg.steps == 7 and cfg.n_embd == PRESETS["tiny"].n_embd
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("medium")
    with pytest.raises(ValueError, match="n_head"):
        get_preset("tiny", n_head=3)
    with pytest.raises(ValueError, match="rows"):
        get_preset("tiny", rows=0)


def test_wan_preset_is_link_bound_at_100mbit():
    """The wan preset's point: AdamW's dense fp32 ring all-reduce over 100 Mbit/s must dwarf its
    compute. Forward + backward cost ~6 flops per parameter and token; a 2-core CPU does well
    under 100 GFLOP/s, so compute per step is under 6 * n * tokens / 1e11 seconds."""
    cfg = get_preset("wan")
    assert cfg.workers == 2 and cfg.rows % cfg.workers == 0
    n = sum(p.numel() for p in build_model(cfg).parameters())
    ring_bytes = 2 * 4 * n * (cfg.workers - 1) / cfg.workers        # fp32, each way per worker
    link_s = 8 * ring_bytes / 100e6
    tokens_per_worker = cfg.rows // cfg.workers * cfg.context
    compute_bound_s = 6 * n * tokens_per_worker / 1e11
    assert link_s > 20 * compute_bound_s
    assert get_preset("wan", workers=3).workers == 3
    with pytest.raises(ValueError, match="workers"):
        get_preset("wan", workers=0)


def test_demo_chunk_and_topk_reach_the_optimizer():
    cfg = get_preset("tiny", demo_chunk=32, demo_topk=15)
    opt = get_optimizer("demo").build(build_model(cfg), cfg, 1e-3).optimizer
    group = opt.param_groups[0]
    assert (group["chunk"], group["topk"], group["values"]) == (32, 15, cfg.settings(DeMoSettings).values)
    plan = opt.compressor(group).plan((4 * cfg.n_embd, cfg.n_embd))     # MLP fc: [256, 64]
    assert (plan.chunk_rows, plan.chunk_cols) == (32, 32)
    assert (PRESETS["wan"].settings(DeMoSettings).chunk, PRESETS["small"].settings(DeMoSettings).chunk) == (32, 64)
    for field in ("chunk", "topk"):
        with pytest.raises(ValueError, match=f"demo: {field} must be"):
            get_preset("small", **{f"demo_{field}": 0})


def test_parse_link():
    assert parse_link("100mbit") == (100e6, 0.0)
    assert parse_link("1gbit,20ms") == (1e9, 0.02)
    with pytest.raises(ValueError, match="rate"):
        parse_link("fast")


def test_registry():
    assert {"adamw", "adam", "muon", "powersgd", "demo"} <= set(OPTIMIZERS)
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        get_optimizer("sgd")


def test_shards_partition_the_global_batch():
    ids = torch.arange(10_000)
    cfg = get_preset("tiny", rows=12)
    full_x, full_y = train_batch(ids, cfg, step=5, rank=0, world=1)
    parts = [train_batch(ids, cfg, 5, r, 3) for r in range(3)]
    for r, (x, y) in enumerate(parts):
        assert torch.equal(x, full_x[r::3]) and torch.equal(y, full_y[r::3])
    assert torch.equal(full_y[:, :-1], full_x[:, 1:])              # targets are inputs shifted by one
    assert not torch.equal(train_batch(ids, cfg, 6, 0, 1)[0], full_x)


def test_stdlib_corpus_split():
    files = stdlib_files()
    assert files == sorted(files) and files
    assert not any("site-packages" in str(f) or "/test/" in str(f) for f in files)
    train, val = load_corpus(None)
    total = sum(f.stat().st_size for f in files)
    assert train.numel() + val.numel() == total
    assert 0.02 * total < val.numel() < 0.1 * total
    assert int(train.max()) < 256


def test_text_dir_and_bin(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes([i]) * 10)
    train, val = load_corpus(str(tmp_path))
    assert val.tolist() == [19] * 10 + [39] * 10                   # every 20th file, in path order
    ids = torch.arange(1000, dtype=torch.int64)
    (tmp_path / "ids.bin").write_bytes(ids.to(torch.int16).numpy().tobytes())
    train, val = load_corpus(str(tmp_path / "ids.bin"), vocab_size=1000)
    assert torch.equal(torch.cat([train, val]), ids) and val.numel() == 50


def test_model_shapes_and_tied_head():
    cfg = get_preset("tiny")
    model = build_model(cfg)
    assert model.head.weight is model.wte.weight
    logits = model(torch.randint(0, 256, (3, cfg.context)))
    assert logits.shape == (3, cfg.context, 256)
    assert torch.equal(build_model(cfg).wte.weight, model.wte.weight)   # same init everywhere


def test_lr_schedule():
    cfg = get_preset("tiny", steps=100)          # warmup 5 steps, cosine to 0.1
    assert lr_factor(0, cfg) == pytest.approx(1 / 5)
    assert lr_factor(4, cfg) == pytest.approx(1.0)
    mid = 5 + 95 / 2
    assert lr_factor(int(mid), cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert lr_factor(99, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 94 / 95)))


def _step(step_s, comm_s, sent, received, coll):
    return {"step_s": step_s, "comm_s": comm_s, "payload_bytes": sent, "link_bytes_sent": sent,
            "link_bytes_received": received, "collectives": coll}


def test_modelled_time_and_time_to_target():
    steps = [_step(1.0, 0.5, 1_000_000, 2_000_000, 2), _step(2.0, 0.0, 0, 0, 1), _step(1.0, 1.0, 125, 125, 1)]
    evals = [{"step": 0, "val_loss": 5.0}, {"step": 2, "val_loss": 3.0}, {"step": 3, "val_loss": 2.0}]
    log = {"steps": steps, "evals": evals, "final": None}
    row = summarize("x", log, target=3.0, latency_s=0.01)
    # at 100 Mbit/s: step 1 = 0.5 s compute + 16e6 bits / 1e8 + 2 x 0.01; step 2 = 2 + 0.01
    assert row["time_to_target_s"]["100mbit"] == pytest.approx(0.5 + 0.16 + 0.02 + 2.01)
    assert row["time_to_target_s"]["measured"] == pytest.approx(3.0)
    assert row["train_time_s"]["10mbit"] == pytest.approx(0.5 + 1.6 + 0.02 + 2.01 + 0 + 1000 / 1e7 + 0.01)
    assert row["payload_bytes_per_step"] == pytest.approx(1_000_125 / 3)
    assert row["val_loss"] == 2.0
    assert time_to_target(evals, {"measured": [0, 1, 2, 3]}, target=1.0) == {"measured": None}


def _timed_all_reduce(rank, world):
    import time

    import torch.distributed as dist

    import thinwire.comm.communicator as communicator
    from thinwire.comm import Communicator
    from thinwire.train.timing import BLOCKED, install
    install()
    BLOCKED[0] = 0.0
    if rank == 1:
        time.sleep(0.5)
    Communicator().all_reduce(torch.ones(4))
    return {"blocked": BLOCKED[0], "dist_untouched": communicator.dist is dist}


def test_timing_counts_blocked_time_through_the_communicator_hook():
    from tests.dist import run_workers
    results = run_workers(_timed_all_reduce, 2)
    assert all(r["dist_untouched"] for r in results)            # a hook, not a replacement of torch.distributed
    assert results[0]["blocked"] >= 0.25                        # rank 0 waited for the late rank 1
    assert 0 <= results[1]["blocked"] < results[0]["blocked"]
