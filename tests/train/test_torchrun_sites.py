"""A store run's sites under torchrun (`python -m thinwire.train --exchange URL --site NAME
--peers A,B`): each torchrun world is one site's workers, the sites sharing only a file://
store and the key: 2 sites x 2 workers end with the parameters of one 4-worker gloo run to
the last bit, and what torchrun cannot run with --exchange is refused before any rank joins."""

from __future__ import annotations

import json
import secrets
import sys

import pytest

from tests.train.shared import TRAIN_MAIN, compare_here, start, train_env, wait
from thinwire.train import cli

RUN = ("--preset", "tiny", "--optimizer", "demo", "--steps", "4", "--eval-every", "4", "--eval-rows", "16",
       "--no-adamw-probe", "--quiet")


@pytest.fixture(scope="module")
def preloaded_env():
    """train_env naming a server that imported the torchrun workers' modules once (test_faults.py's)."""
    from tests.integrations.launch import preloaded
    with preloaded(TRAIN_MAIN, train_env(THINWIRE_EXCHANGE_KEY=secrets.token_hex(32))) as env:
        yield env


def _site(tmp, site: str, env: dict):
    """One site: a torchrun agent of 2 workers (forked from the preloaded server, as test_faults.py's)."""
    from tests.integrations.launch import WORKER
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.2", str(WORKER), str(TRAIN_MAIN), *RUN, "--exchange", (tmp / "store").as_uri(),
           "--round-timeout", "120", "--site", site, "--peers", "a,b", "--out", str(tmp / site)]
    return start(cmd, env=env)


def test_two_torchrun_sites_end_with_the_parameters_of_one_gloo_run(tmp_path, preloaded_env):
    sites = [_site(tmp_path, s, preloaded_env) for s in ("a", "b")]
    gloo = compare_here(tmp_path / "gloo", "--preset", "tiny", "--workers", "4", *RUN[4:], "--optimizers", "demo")
    for proc in sites:
        done = wait(proc, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
    want = gloo["logs"]["demo"]["final"][0]["params_sha256"]
    for site in ("a", "b"):
        records = [json.loads(line) for line in (tmp_path / site / "demo.jsonl").read_text().splitlines()]
        final = next(r for r in records if r["kind"] == "final")
        assert final["params_sha256"] == want and final["store"]["missed_rounds"] == 0
        summary = json.loads((tmp_path / site / "summary.json").read_text())
        assert summary["site"]["site"] == site and summary["runs"][0]["workers"] == 4


@pytest.mark.parametrize("extra, message", [
    ((), "--exchange under torchrun runs one site of a store run: give --site NAME"),
    (("--site", "a", "--peers", "a,b"), "--site needs the run's signing key"),
])
def test_what_torchrun_cannot_run_with_the_store_is_refused_before_any_rank_joins(extra, message, tmp_path,
                                                                                   monkeypatch, capsys):
    monkeypatch.delenv("THINWIRE_EXCHANGE_KEY", raising=False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.torchrun_main([*RUN, "--exchange", (tmp_path / "store").as_uri(), *extra])
    assert message in str(exit_.value)
    assert not (tmp_path / "store").exists()
