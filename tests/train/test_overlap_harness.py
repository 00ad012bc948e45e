"""Issue 15 in the harness: --overlap and the "-overlap" entries, dense AdamW / Adam as torch
DDP (bytes counted exactly, compute-only time measured with communication off, nothing of
the run changed by that measurement), and the no-communication limit in every row. The
entries run in the tiny-preset `thinwire compare` shared with two other files (shared.py)."""

import statistics
from dataclasses import replace

import pytest
import torch

from tests.train.shared import TINY, compare_here
from thinwire.train.cli import main
from thinwire.train.config import get_preset
from thinwire.train.model import build_model
from thinwire.train.optimizers import OPTIMIZERS, get_optimizer
from thinwire.train.report import add_limits, format_table, summarize

V, C, T = 256, 64, 32                        # tiny preset: vocab, width, context (one block)
N_PARAMS = V * C + T * C + 12 * C * C + 3 * C
VARIANTS = ("demo", "ef21-muon", "apmsqueeze", "lordo", "diloco", "sign-demo")


def test_overlap_entries_and_refusals():
    for name in VARIANTS:
        spec = get_optimizer(f"{name}-overlap")
        assert spec.overlap and not spec.dense and spec.can_overlap
        assert spec.default_lr == get_optimizer(name).default_lr
        assert spec.counterpart == get_optimizer(name).counterpart and spec.on_shards == get_optimizer(name).on_shards
    assert not any(OPTIMIZERS[n].can_overlap for n in ("adamw", "adam", "powersgd"))
    assert all(OPTIMIZERS[n].can_overlap for n in ("adamw-allreduce", "adam-allreduce", "muon", *VARIANTS))


@pytest.mark.parametrize("name, message", [
    ("powersgd", "--overlap: powersgd cannot overlap"),
    ("adamw", "DDP overlaps its bucketed all-reduce with backward by itself; adamw-allreduce"),
    ("adam", "--overlap: adam cannot overlap"),
])
def test_overlap_refused_before_spawning(name, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--preset", "tiny", "--overlap", "--optimizers", f"demo,{name}"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_overlap_reaches_every_thinwire_optimizer():
    cfg = get_preset("tiny")
    for name in ("adamw-allreduce", "adam-allreduce", "muon", *VARIANTS):
        assert get_optimizer(name).build(build_model(cfg), cfg, 1e-3).optimizer.overlap is False, name
        on = get_optimizer(name).build(build_model(cfg), replace(cfg, overlap=True), 1e-3).optimizer
        assert on.overlap is True, name
        if name in VARIANTS:
            assert get_optimizer(f"{name}-overlap").build(build_model(cfg), cfg, 1e-3).optimizer.overlap is True


def test_delayed_entries_keep_each_sync_in_flight_for_a_whole_interval():
    cfg = replace(get_preset("tiny"), sync_every=5)
    for name in ("diloco", "sparseloco"):
        spec = get_optimizer(f"{name}-delayed")
        assert spec.overlap and spec.on_shards and spec.default_lr == get_optimizer(name).default_lr
        opt = spec.build(build_model(cfg), cfg, 1e-3).optimizer
        assert (opt.overlap, opt.delay, opt.sync_every) == (True, 5, 5), name
        assert get_optimizer(name).build(build_model(cfg), cfg, 1e-3).optimizer.delay == 1
        shorter = get_preset("tiny", sync_every=5, sync_delay=3)                # --sync-delay 3
        assert spec.build(build_model(shorter), shorter, 1e-3).optimizer.delay == 3, name
    with pytest.raises(ValueError, match="sync_delay"):
        get_preset("tiny", sync_every=5, sync_delay=6)


def test_sparseloco_compression_flags_reach_the_optimizer():
    """--sparseloco-topk/-chunk/-values/-indices/-error-decay/-outer-lr/-eager-scale build SparseLoCo (and its
    delayed entry) with that compression, β, α and eager jump; without them it is the paper's
    (top-128 of 64 x 64, 2-bit, β 0.95, α 1) with the eager jump at c = 1."""
    from thinwire.train.cli import build_parser, config_from_args
    argv = ["compare", "--preset", "tiny", "--sparseloco-topk", "32", "--sparseloco-chunk", "32",
            "--sparseloco-values", "int8", "--sparseloco-error-decay", "0.8", "--sparseloco-outer-lr", "1.5",
            "--sparseloco-eager-scale", "2", "--sparseloco-indices", "elias-fano"]
    cfg = config_from_args(build_parser().parse_args(argv))
    for name in ("sparseloco", "sparseloco-delayed"):
        opt = get_optimizer(name).build(build_model(cfg), cfg, 1e-3).optimizer
        c = opt.compressor
        assert (c.topk, c.chunk, c.codec.name, opt.error_decay, opt.outer_lr) == (32, 32, "int8", 0.8, 1.5), name
        assert opt.eager_scale == 2.0 and c.indices == "elias-fano", name
    default = config_from_args(build_parser().parse_args(["compare", "--preset", "tiny"]))
    opt = get_optimizer("sparseloco").build(build_model(default), default, 1e-3).optimizer
    c = opt.compressor
    assert (c.topk, c.chunk, c.codec.name, c.indices, opt.error_decay, opt.outer_lr, opt.eager_scale) == \
        (128, 64, "2bit", "packed", 0.95, 1.0, 1.0)


def test_diloco_outer_flags_reach_the_optimizer():
    """--diloco-outer-lr/-momentum build DiLoCo (and its delayed entry) with that outer step;
    without them it is the published Nesterov 0.7 / 0.9."""
    from thinwire.train.cli import build_parser, config_from_args
    argv = ["compare", "--preset", "tiny", "--diloco-outer-lr", "1", "--diloco-outer-momentum", "0"]
    cfg = config_from_args(build_parser().parse_args(argv))
    for name in ("diloco", "diloco-delayed"):
        opt = get_optimizer(name).build(build_model(cfg), cfg, 1e-3).optimizer
        assert (opt.outer_lr, opt.outer_momentum) == (1.0, 0.0), name
    default = config_from_args(build_parser().parse_args(["compare", "--preset", "tiny"]))
    opt = get_optimizer("diloco").build(build_model(default), default, 1e-3).optimizer
    assert (opt.outer_lr, opt.outer_momentum) == (0.7, 0.9)


def _ddp_run(rank, world, calibrate: bool):
    from thinwire.train.data import train_batch
    from thinwire.train.worker import _timed_step
    torch.manual_seed(0)
    cfg = get_preset("tiny", workers=world)
    ids = torch.randint(0, 256, (20_000,))
    built = get_optimizer("adamw").build(build_model(cfg), cfg, 3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda s: 1.0)
    compute = built.calibrate(lambda i: train_batch(ids, cfg, 100 + i, rank, world)) if calibrate else None
    recs = [_timed_step(built, sched, *train_batch(ids, cfg, s, rank, world)) for s in range(3)]
    params = torch.cat([p.detach().flatten() for p in built.model.module.parameters()])
    return {"compute": compute, "recs": recs, "params": params, "totals": built.stats.state_dict()["totals"]}


def test_ddp_bytes_exact_and_calibration_changes_nothing():
    from tests.dist import run_workers
    plain = run_workers(_ddp_run, 2, args=(False,))
    calibrated = run_workers(_ddp_run, 2, args=(True,))
    for rank in range(2):
        assert torch.equal(plain[rank]["params"], calibrated[rank]["params"])     # the run is the same run
        assert calibrated[rank]["compute"] > 0 and plain[rank]["compute"] is None
        for rec in calibrated[rank]["recs"]:                                      # the fp32 gradient, ring W = 2
            assert rec["payload_bytes"] == 4 * N_PARAMS and rec["link_bytes_sent"] == 4 * N_PARAMS
            assert rec["comm_s"] == 0.0                                           # DDP waits inside backward
        assert calibrated[rank]["totals"]["payload_bytes"] == 3 * 4 * N_PARAMS    # calibration sends nothing
    assert torch.equal(calibrated[0]["params"], calibrated[1]["params"])


def _step(step_s, comm_s):
    return {"step_s": step_s, "comm_s": comm_s, "payload_bytes": 10, "link_bytes_sent": 10,
            "link_bytes_received": 10, "collectives": 1}


def test_limits_arithmetic():
    evals = [{"step": 0, "val_loss": 5.0}, {"step": 2, "val_loss": 3.0}, {"step": 4, "val_loss": 2.0}]
    ddp = {"steps": [_step(1.0, 0.0)] * 4, "evals": evals,
           "final": {"compute_only_step_s": 0.25, "comm_stats": {"by_tag": {}}, "n_params": 1}}
    ours = {"steps": [_step(0.5, 0.2)] * 4, "evals": evals, "final": None}
    probed = {"steps": [_step(0.5, 0.2)] * 4, "evals": evals,
              "final": {"adamw_step_s": 0.2, "comm_stats": {"by_tag": {}}, "n_params": 1}}
    rows = [summarize("adamw", ddp, 2.5, 0.0), summarize("demo", ours, 2.5, 0.0), summarize("sparseloco", probed, 2.5, 0.0)]
    assert add_limits(rows) is rows[0]
    a, d, s = rows
    assert d["ratio_to_dense_limit_here"] is None                                # no AdamW step timed in its run
    assert s["ratio_to_dense_limit_here"] == pytest.approx(2.0 / (4 * 0.2))      # 4 x 0.5 s / (AdamW's 4 steps x 0.2 s)
    assert s["adamw_step_during_s"] is None                                      # a log without samples
    sampled = [{"step": 0, "val_loss": 5.0}, {"step": 2, "val_loss": 3.0, "adamw_probe_s": [0.3, 0.1, 0.4]},
               {"step": 4, "val_loss": 2.0, "adamw_probe_s": [0.5, 0.2, 0.6]}, {"step": 6, "val_loss": 1.9,
               "adamw_probe_s": [9.0, 9.0, 9.0]}]
    s = summarize("sparseloco", {**probed, "steps": [_step(0.5, 0.2)] * 6, "evals": sampled}, 2.5, 0.0)
    add_limits([a, s])
    assert s["adamw_step_during_s"] == pytest.approx(2.1 / 6)    # mean of the 6 samples to its target (step 4)
    assert s["adamw_step_during_median_s"] == pytest.approx(0.35)
    assert s["ratio_to_dense_limit_here"] == pytest.approx(2.0 / (4 * 2.1 / 6))    # the samples, not the calibration
    assert (s["dense_steps_to_target"], s["dense_steps_of"]) == (4, "adamw")
    add_limits([s], dense_steps=3)                 # no AdamW row: its steps to target given (--dense-steps)
    assert s["dense_limit_s"] is None and s["ratio_to_dense_limit"] is None
    assert (s["dense_steps_to_target"], s["dense_steps_of"]) == (3, "--dense-steps")
    assert s["ratio_to_dense_limit_here"] == pytest.approx(2.0 / (3 * 2.1 / 6))
    assert "from --dense-steps (3)" in format_table([s], None)
    add_limits([s])
    assert s["ratio_to_dense_limit_here"] is None and s["dense_steps_of"] is None
    assert (a["steps_to_target"], a["compute_only_step_s"], a["no_comm_limit_s"]) == (4, 0.25, 1.0)
    assert a["time_to_target_s"]["compute"] == pytest.approx(1.0)                 # calibrated compute drives models
    assert a["time_to_target_s"]["10mbit"] == pytest.approx(4 * (0.25 + 80 / 10e6))
    assert d["compute_only_step_s"] == pytest.approx(0.3) and d["no_comm_limit_s"] == pytest.approx(1.2)
    assert d["dense_limit_s"] == 1.0 and d["ratio_to_dense_limit"] == pytest.approx(2.0)   # 4 x 0.5 s / 1.0 s
    assert a["ratio_to_dense_limit"] == pytest.approx(4.0)
    assert add_limits([d]) is None and d["ratio_to_dense_limit"] is None


@pytest.fixture(scope="module")
def runs(tiny_compare, tmp_path_factory):
    """The shared run (adamw, adamw-allreduce, demo and its overlap entries among its rows) and
    DeMo alone under --overlap with the same flags."""
    flag = compare_here(tmp_path_factory.mktemp("flag"), *TINY, "--optimizers", "demo", "--overlap", "--target", "3.6")
    return [(r["rows"], r["logs"], r["stdout"]) for r in (tiny_compare, flag)]


def test_rows_carry_the_limit(runs):
    (rows, logs, stdout), _ = runs
    assert "x dense AdamW's limit" in stdout and "| demo-overlap | yes |" in stdout and "| demo | no |" in stdout
    limit = rows["adamw"]["no_comm_limit_s"]
    assert limit == pytest.approx(rows["adamw"]["steps_to_target"] * rows["adamw"]["compute_only_step_s"])
    final = logs["adamw"]["final"][0]
    assert rows["adamw"]["compute_only_step_s"] == final["compute_only_step_s"] > 0
    calibration = final["calibration"]                                   # before and after training, the smaller kept
    assert final["compute_only_step_s"] == min(calibration["before_s"], calibration["after_s"])
    assert rows["adamw"]["ratio_to_dense_limit_here"] is None           # DDP calibrates its own step instead
    for name, row in rows.items():
        probe = logs[name]["final"][0].get("adamw_probe")
        assert (probe is None) == ("calibration" in logs[name]["final"][0]), name     # one or the other
        if probe is None:
            continue
        assert row["adamw_step_s"] == min(probe["before_s"], probe["after_s"]) > 0, name
        evals = logs[name]["eval"]
        assert "adamw_probe_s" not in evals[0], name                         # step 0: before training
        assert all(len(e["adamw_probe_s"]) == 3 and min(e["adamw_probe_s"]) > 0 for e in evals[1:]), name
        measured, hit = row["time_to_target_s"]["measured"], row["steps_to_target"]
        samples = [t for e in evals[1:] if hit is None or e["step"] <= hit for t in e["adamw_probe_s"]]
        assert row["adamw_step_during_s"] == pytest.approx(statistics.fmean(samples)), name
        assert row["adamw_step_during_median_s"] == pytest.approx(statistics.median(samples)), name
        here = rows["adamw"]["steps_to_target"] * row["adamw_step_during_s"]
        assert row["ratio_to_dense_limit_here"] == (None if measured is None else pytest.approx(measured / here)), name
    for name, row in rows.items():
        assert row["dense_limit_s"] == limit and row["dense_limit_of"] == "adamw"
        measured = row["time_to_target_s"]["measured"]
        assert row["ratio_to_dense_limit"] == (None if measured is None else pytest.approx(measured / limit))
        assert row["overlap"] == (name.endswith(("-overlap", "-delayed")) or name == "demo-lookahead")


def test_ddp_and_allreduce_baselines(runs):
    (rows, logs, _), _ = runs
    dense = 4 * (N_PARAMS + 1 + 16 + 9)          # DenseAllReduce: the gradient and its float trailer
    ar = logs["adamw-allreduce"]["step"]
    assert ar[0]["payload_bytes"] == dense + 8 and all(r["payload_bytes"] == dense for r in ar[1:])
    ddp = logs["adamw"]["step"]
    assert all(r["payload_bytes"] == 4 * N_PARAMS and r["collectives"] >= 1 for r in ddp)
    # the same AdamW on the same mean gradient: the same loss (up to fp32 summation order)
    assert rows["adamw"]["val_loss"] == pytest.approx(rows["adamw-allreduce"]["val_loss"], rel=1e-3)


def _losses(log: dict) -> list[float]:
    return [r["loss"] for r in log["step"]]


def test_overlap_flag_equals_overlap_entry(runs):
    (rows, logs, _), (flag_rows, flag_logs, _) = runs
    assert flag_rows["demo"]["overlap"] is True
    assert _losses(flag_logs["demo"]) == _losses(logs["demo-overlap"])              # bit for bit
    assert _losses(logs["demo"]) != _losses(logs["demo-overlap"])                   # gradients one update late
    assert _losses(logs["demo"])[0] == _losses(logs["demo-overlap"])[0]
    assert rows["demo-overlap"]["val_loss"] == pytest.approx(rows["demo"]["val_loss"], rel=0.05)
    # same bytes per step: overlap moves the wait, not the message
    assert rows["demo-overlap"]["payload_bytes_per_step"] == rows["demo"]["payload_bytes_per_step"]


def test_lookahead_entry_is_overlap_with_other_gradients(runs):
    """demo-lookahead: overlap with the same bytes as DeMo, its first loss DeMo's, and from
    then on gradients taken at the looked-ahead parameters, not demo-overlap's."""
    (rows, logs, _), _ = runs
    assert rows["demo-lookahead"]["overlap"] is True
    assert rows["demo-lookahead"]["payload_bytes_per_step"] == rows["demo"]["payload_bytes_per_step"]
    assert _losses(logs["demo-lookahead"])[0] == _losses(logs["demo"])[0]
    assert _losses(logs["demo-lookahead"])[2:] != _losses(logs["demo-overlap"])[2:]
