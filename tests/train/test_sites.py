"""`--sites`: two tiers on real gloo processes. One `thinwire compare` of HSDP AdamW and DeMo
on the tiny preset with 4 workers as 2 sites x 2 ranks, and the same with --sites 4 (one rank
per site: the flat path) for reference; then the user errors, which come before any worker
starts (PowerSGD's DDP hook), and the helpers (optimizer-state bytes, site sums, modelled time over a site's link)."""

import math

import pytest
import torch

from tests.train.shared import compare_here
from thinwire.optim import DenseAllReduce, DiLoCo
from thinwire.train.cli import main
from thinwire.train.config import get_preset
from thinwire.train.model import build_model
from thinwire.train.report import summarize
from thinwire.train.run import check_run
from thinwire.train.sites import Tiers, optimizer_state_bytes, site_sums

OPTIMIZERS = ("adamw", "demo")
STEPS, EVERY = 12, 6
# 4 workers of one window each; 17 validation windows: rank 0 scores 5, the others 4, so with
# 4 windows per forward ranks 1-3 run a spare forward for FSDP2's all-gathers (and count nothing)
ARGS = ["--preset", "tiny", "--workers", "4", "--rows", "4", "--eval-rows", "17", "--steps", str(STEPS),
        "--eval-every", str(EVERY), "--optimizers", ",".join(OPTIMIZERS)]
CFG = get_preset("tiny")
PARAMS = list(build_model(CFG).parameters())              # unique: the head is tied to wte
N = sum(p.numel() for p in PARAMS)


def _shard_numel(p: torch.Tensor, shards: int) -> int:
    """FSDP2's shard of p: dim 0 split as torch.chunk, padded to ceil(rows / shards) rows."""
    return math.ceil(p.shape[0] / shards) * (p.numel() // p.shape[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run on 2 and on 4 sites, one after the other in this process (compare_here: no
    launcher interpreter or server of its own, ~9 s of CPU each, more than running the two
    launchers side by side saved on 2 cores)."""
    outs = {sites: tmp_path_factory.mktemp(f"sites{sites}") for sites in (2, 4)}
    return {sites: compare_here(out, *ARGS, "--sites", str(sites)) for sites, out in outs.items()}


def test_summary_reports_each_tier(runs):
    two = runs[2]
    assert two["summary"]["sites"] == 2
    assert "inter-site payload MB/step/worker" in two["stdout"] and "intra-site MB/step/worker" in two["stdout"]
    for row in two["rows"].values():
        assert (row["sites"], row["ranks_per_site"]) == (2, 2)
        assert set(row["inter_site"]) == {"payload_bytes_per_step_per_worker", "payload_bytes_per_step_per_site",
                                          "link_bytes_per_step_per_site", "link_bytes_received_per_step_per_site"}
        assert set(row["intra_site"]) == {"payload_bytes_per_step_per_worker", "link_bytes_per_step_per_worker",
                                          "collectives_per_step"}
        assert row["payload_bytes_per_step"] == row["inter_site"]["payload_bytes_per_step_per_worker"]
        assert len(row["optimizer_state_bytes_by_rank"]) == 4
        assert "compute" in row["time_to_target_s"] and row["train_time_s"]["compute"] <= row["train_time_s"]["measured"]


def test_hsdp_adamw_all_reduces_each_shard_across_sites(runs):
    """Each rank all-reduces its FSDP2 shard of the fp32 gradient with its peer in the other
    site, one all-reduce per FSDP unit (each block, the root); the two ranks of a site
    together send the whole gradient: n bytes each way per rank for a ring of two."""
    row, steps = runs[2]["rows"]["adamw"], runs[2]["logs"]["adamw"]["step"]
    shard = 4 * sum(_shard_numel(p, 2) for p in PARAMS)
    assert all(s["payload_bytes"] == shard and s["link_bytes_sent"] == shard for s in steps)
    assert all(s["collectives"] == CFG.n_layer + 1 for s in steps)
    assert row["inter_site"]["payload_bytes_per_step_per_site"] == 2 * shard == 4 * N   # tiny's rows are even
    assert row["inter_site"]["link_bytes_per_step_per_site"] == 2 * shard


def test_bytes_equal_the_counters(runs):
    for name in OPTIMIZERS:
        steps, stats = runs[2]["logs"][name]["step"], runs[2]["logs"][name]["final"][0]["comm_stats"]["totals"]
        for key in ("payload_bytes", "link_bytes_sent", "collectives"):
            assert sum(s[key] for s in steps) == stats[key], (name, key)


def test_intra_site_bytes_are_fsdp2_gathers_and_reduce_scatters(runs):
    """Inside a site every step reduce-scatters the whole fp32 gradient (4N bytes in); a step
    that does not follow an evaluation also all-gathers this rank's shard (parameters stay
    gathered from an evaluation's forward). The flat path moves nothing inside a site."""
    shard = 4 * sum(_shard_numel(p, 2) for p in PARAMS)
    for name in OPTIMIZERS:
        for s in runs[2]["logs"][name]["step"]:
            after_eval = (s["step"] - 1) % EVERY == 0
            assert s["intra_payload_bytes"] == 2 * shard + (0 if after_eval else shard), (name, s["step"])
        assert runs[4]["rows"][name]["intra_site"]["payload_bytes_per_step_per_worker"] == 0


def test_one_rank_per_site_is_the_flat_path(runs):
    """--sites 4 with 4 workers: DDP's fp32 gradient, exactly (as without --sites); HSDP over 2
    sites is the same data-parallel AdamW, so the losses agree."""
    steps = runs[4]["logs"]["adamw"]["step"]
    assert all(s["payload_bytes"] == 4 * N for s in steps)
    hsdp, flat = runs[2]["logs"]["adamw"]["eval"], runs[4]["logs"]["adamw"]["eval"]
    assert hsdp[0]["val_loss"] == pytest.approx(flat[0]["val_loss"], rel=1e-6)     # the same windows, counted once
    assert hsdp[-1]["val_loss"] == pytest.approx(flat[-1]["val_loss"], rel=1e-3)


def test_optimizer_state_is_sharded(runs):
    for name in OPTIMIZERS:
        two, one = runs[2]["rows"][name], runs[4]["rows"][name]
        assert two["optimizer_state_bytes_per_rank"] <= 0.55 * one["optimizer_state_bytes_per_rank"], name
    # AdamW: two fp32 moments per element and a float32 step per parameter
    assert runs[4]["rows"]["adamw"]["optimizer_state_bytes_per_rank"] == 8 * N + 4 * len(PARAMS)
    assert runs[2]["rows"]["adamw"]["optimizer_state_bytes_per_rank"] == 8 * N // 2 + 4 * len(PARAMS)


def test_demo_trains_and_sends_far_less_across_sites(runs):
    rows, logs = runs[2]["rows"], runs[2]["logs"]
    assert rows["adamw"]["payload_bytes_per_step"] / rows["demo"]["payload_bytes_per_step"] > 50
    for name in OPTIMIZERS:
        evals = logs[name]["eval"]
        assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0, name


@pytest.mark.parametrize("argv, message", [
    (["--sites", "3"], "--sites must be a divisor of --workers (4)"),
    (["--sites", "8"], "--sites must be a divisor of --workers (4)"),
    (["--sites", "-1"], "sites must be >= 0"),
])
def test_bad_sites_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--preset", "tiny", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_powersgd_refused_before_any_worker_starts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--preset", "tiny", "--sites", "2", "--optimizers", "adamw,powersgd", "--out", str(tmp_path)])
    assert "powersgd is PyTorch's DDP communication hook" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())                      # adamw, listed first, never ran
    check_run(get_preset("tiny", sites=4), ["powersgd"], 4, None)      # one rank per site: flat, allowed
    check_run(get_preset("tiny", sites=2), ["muon", "ef21-muon", "lordo"], 4, None)   # they run on shards


def test_optimizer_state_bytes_include_wrapped_optimizers():
    model = build_model(CFG)
    inner = torch.optim.AdamW(model.parameters())
    dense = DenseAllReduce(inner)
    diloco = DiLoCo(build_model(CFG).parameters(), sync_every=2)
    for opt in (dense, diloco):
        model_of = [p for g in opt.param_groups for p in g["params"]]
        sum(p.sum() for p in model_of).backward()
        opt.step()
    assert optimizer_state_bytes(dense) == optimizer_state_bytes(inner) == 8 * N + 4 * len(PARAMS)
    assert optimizer_state_bytes(diloco) > optimizer_state_bytes(diloco.inner) == 8 * N + 4 * len(PARAMS)


def test_site_sums_and_modelled_time_over_a_sites_link():
    tiers = Tiers(sites=2, ranks_per_site=2)
    per_rank = [[(1, 10, 20)], [(2, 30, 40)], [(4, 5, 5)], [(8, 5, 5)]]       # one step, 4 ranks
    assert site_sums(per_rank, tiers) == {"payload_bytes": [12], "link_bytes_sent": [40],
                                          "link_bytes_received": [60]}
    step = {"step_s": 1.0, "comm_s": 0.5, "payload_bytes": 1, "link_bytes_sent": 10, "link_bytes_received": 20,
            "collectives": 1}
    final = {"comm_stats": {"totals": {}, "by_tag": {}}, "n_params": 1, "optimizer_state_bytes": 8,
             "tiers": {"sites": 2, "ranks_per_site": 2, "optimizer_state_bytes": [8, 6, 8, 6],
                       "site": {"payload_bytes": [12], "link_bytes_sent": [40e6 / 8], "link_bytes_received": [0]}}}
    row = summarize("x", {"steps": [step], "evals": [{"step": 1, "val_loss": 1.0}], "final": final},
                    target=2.0, latency_s=0.0)
    assert row["time_to_target_s"]["100mbit"] == pytest.approx(0.5 + 40e6 / 100e6)   # the site's bytes, not rank 0's
    assert row["time_to_target_s"]["compute"] == pytest.approx(0.5)
    assert row["optimizer_state_bytes_per_rank"] == 8
