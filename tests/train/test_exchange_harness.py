"""`thinwire compare --exchange URL` (train/store_runs.py): the optimizers' messages through a
file:// store, each worker a site (or, with --sites, FSDP2 inside each site and the store
across them), against the same command over torch.distributed: with no round missed the same
trajectory to the last bit, the same payload bytes; and the runs it cannot take refused before
any worker starts."""

from __future__ import annotations

import pytest

from tests.train.shared import compare_here
from thinwire.train.cli import main

ARGS = ("--preset", "tiny", "--workers", "2", "--steps", "6", "--eval-every", "3", "--eval-rows", "16",
        "--sync-every", "2", "--no-adamw-probe", "--optimizers", "demo,sign-demo,sparseloco")


def _gloo_and_store(tmp_path_factory, args: tuple) -> tuple[dict, dict, object]:
    """The compare run of `args` over gloo, then through a fresh file:// store: (gloo, store run, its folder)."""
    store = tmp_path_factory.mktemp("rounds")
    gloo = compare_here(tmp_path_factory.mktemp("gloo"), *args)
    return gloo, compare_here(tmp_path_factory.mktemp("store"), *args, "--exchange", store.as_uri()), store


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    return _gloo_and_store(tmp_path_factory, ARGS)


def test_the_store_run_is_the_gloo_run_to_the_last_bit(both):
    gloo, through, _ = both
    for name in ("demo", "sign-demo", "sparseloco"):
        losses = [[r["loss"] for r in run["logs"][name]["step"]] for run in (gloo, through)]
        assert losses[0] == losses[1], name
        evals = [[r["val_loss"] for r in run["logs"][name]["eval"]] for run in (gloo, through)]
        assert evals[0] == evals[1], name
        sent = [[r["payload_bytes"] for r in run["logs"][name]["step"]] for run in (gloo, through)]
        assert sent[0] == sent[1] and sum(sent[1]) > 0, name
        finals = [run["logs"][name]["final"][0] for run in (gloo, through)]
        assert finals[0]["params_sha256"] == finals[1]["params_sha256"], name


def test_a_store_round_is_timed_as_blocked_in_collectives(both):
    """comm_s (train/timing.py) counts the store's rounds as it counts gloo's all_gathers: every
    step that exchanged (payload bytes > 0; SparseLoCo every --sync-every 2) has comm_s > 0."""
    gloo, through, _ = both
    for name in ("demo", "sign-demo", "sparseloco"):
        for run in (gloo, through):
            exchanged = [r for r in run["logs"][name]["step"] if r["payload_bytes"] > 0]
            assert len(exchanged) >= 3 and all(0 < r["comm_s"] <= r["step_s"] for r in exchanged), name


def test_the_final_record_has_every_workers_rounds_and_traffic(both):
    _, through, _ = both
    store = through["logs"]["demo"]["final"][0]["store"]
    assert [p["participant"] for p in store["participants"]] == ["worker-0000", "worker-0001"]
    assert store["missed_rounds"] == 0 and all(p["rounds"] == 7 for p in store["participants"])  # handshake + 6
    assert store["traffic"]["requests"] == sum(p["traffic"]["requests"] for p in store["participants"]) > 0


def test_each_optimizer_wrote_its_rounds_under_the_url(both):
    _, _, store = both
    runs = [p for p in store.iterdir() if p.is_dir()]
    assert len(runs) == 1 and runs[0].name.startswith("run-")
    assert {p.name for p in runs[0].iterdir()} == {"demo", "sign-demo", "sparseloco"}
    assert all(any(p.rglob("*")) for p in runs[0].iterdir())


TIERS = ("--preset", "tiny", "--workers", "4", "--sites", "2", "--steps", "4", "--eval-every", "4", "--eval-rows",
         "16", "--sync-every", "2", "--no-adamw-probe", "--optimizers", "demo,sparseloco")


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    """2 sites x 2 ranks, FSDP2 inside each site: the optimizer across sites over gloo (the
    mesh's site group) and through a file:// store (a StoreGroup per shard)."""
    return _gloo_and_store(tmp_path_factory, TIERS)


def test_fsdp2_inside_sites_and_the_store_across_them_is_the_gloo_run_to_the_last_bit(tiers):
    gloo, through, _ = tiers
    for name in ("demo", "sparseloco"):
        runs = [run["logs"][name] for run in (gloo, through)]
        losses = [[r["loss"] for r in log["step"]] for log in runs]
        assert losses[0] == losses[1], name
        evals = [[r["val_loss"] for r in log["eval"]] for log in runs]
        assert evals[0] == evals[1], name
        finals = [log["final"][0] for log in runs]
        assert finals[0]["params_sha256"] == finals[1]["params_sha256"], name
        assert finals[1]["tiers"]["sites"] == 2 and finals[1]["tiers"]["ranks_per_site"] == 2
        assert sum(r["payload_bytes"] for r in runs[1]["step"]) == sum(r["payload_bytes"] for r in runs[0]["step"]) > 0


def test_each_shard_has_its_own_rounds_between_the_sites(tiers):
    """Shard k of every site exchanges with shard k of the others: one StoreGroup per shard,
    whose participants are the sites; every rank took every round."""
    _, through, store = tiers
    run = next(p for p in store.iterdir() if p.is_dir())
    for name in ("demo", "sparseloco"):
        assert sorted(p.name for p in (run / name).iterdir()) == ["shard-000", "shard-001"], name
        record = through["logs"][name]["final"][0]["store"]
        assert sorted(p["participant"] for p in record["participants"]) == ["site-000", "site-000", "site-001",
                                                                            "site-001"]
        assert record["missed_rounds"] == 0


@pytest.mark.parametrize("extra, message", [
    (("--optimizers", "adamw"), "--exchange: adamw is a torch.distributed baseline"),
    (("--optimizers", "lordo"), "--exchange: lordo cannot keep a message that misses a store round"),
    (("--optimizers", "diloco"), "--exchange: diloco cannot keep a message"),            # its fp32 sync: all_reduce
    (("--optimizers", "demo", "--exchange", "http://example.invalid/x"), "--exchange must be a file:///folder"),
    (("--optimizers", "demo", "--round-timeout", "0"), "--round-timeout must be > 0"),
])
def test_what_the_store_cannot_run_is_refused_before_any_worker_starts(extra, message, tmp_path, capsys):
    argv = ["compare", "--preset", "tiny", "--exchange", tmp_path.as_uri(), *extra]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())                       # nothing was written to the store
