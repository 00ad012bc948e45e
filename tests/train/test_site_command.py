"""`thinwire train --exchange URL --site NAME --peers a,b` (train/site_run.py): each site its own
command, sharing nothing but the store. 2 sites x 2 workers of DeMo, as real processes started
side by side over a file:// store, each in its own network namespace with no route to the other
where namespaces can be made (one site given the key in a file, the other in the
environment): both sites end with the same parameters, to the last bit those of one 4-worker
gloo run of the same config; and what a site command cannot run is refused before any worker
starts, the store left empty; and with --sites 2 each site's workers shard the model with FSDP2,
to the last bit the parameters of one gloo run of 2 sites x 2 ranks. (The per-site path does not depend on the optimizer or the kind
of store: SparseLoCo and s3:// through the store are test_exchange_harness.py's and
tests/store's; a site pair each costs ~14 s of CPU.)"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
import threading
from dataclasses import replace

import pytest

from tests.train.shared import compare_here, start, train_env, wait
from thinwire.train.cli import main
from thinwire.train.netns import available
from thinwire.train.netns_isolated import IsolatedSites

RUN = ("--preset", "tiny", "--workers", "2", "--steps", "4", "--eval-every", "4", "--eval-rows", "16",
       "--sync-every", "2", "--no-adamw-probe", "--quiet")
SITES = ("a", "b")


def _final(out) -> dict:
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return next(r for r in lines if r["kind"] == "final")


def _site(tmp, site: str, optimizer: str, url: str, env: dict, *flags: str, namespace: str | None = None):
    argv = ["train", "--optimizer", optimizer, *RUN, "--exchange", url, "--round-timeout", "120",
            "--site", site, "--peers", ",".join(SITES), "--out", str(tmp / f"{optimizer}-{site}"), *flags]
    return start([sys.executable, "-m", "thinwire", *argv], env=env, namespace=namespace)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two site commands run side by side while the 4-worker gloo run runs in this process;
    where namespaces can be made (root, iproute2), each site in its own, with no route to the
    other (`IsolatedSites`): the folder is all they share."""
    tmp = tmp_path_factory.mktemp("sites")
    key = secrets.token_hex(32)
    key_file = tmp / "key"
    key_file.write_text(key + "\n")
    sites = [(train_env(), ("--exchange-key-file", str(key_file))), (train_env(THINWIRE_EXCHANGE_KEY=key), ())]
    return tmp, _site_pair_beside_gloo(tmp, sites, ())


def _site_pair_beside_gloo(tmp, sites: list[tuple[dict, tuple]], flags: tuple) -> dict:
    """Both site commands of DeMo (each its (env, flags), then `flags`) side by side, each in its
    own namespace where namespaces can be made, while the 4-worker gloo run of `flags` runs in
    this process; every site command must succeed. Returns the gloo run."""
    folder = (tmp / "store").as_uri()
    with IsolatedSites(len(SITES), rate_bps=1e9) if available()[0] else contextlib.nullcontext() as net:
        spaces = net.namespaces if net is not None else [None, None]
        procs = [_site(tmp, site, "demo", folder, env, *own, *flags, namespace=space)
                 for site, (env, own), space in zip(SITES, sites, spaces)]
        gloo = compare_here(tmp / "gloo", *RUN[:2], "--workers", "4", *flags, *RUN[4:], "--optimizers", "demo")
        done = [wait(p, timeout=300) for p in procs]
    for p in done:
        assert p.returncode == 0, p.stdout[-3000:]
    return gloo


def test_both_sites_end_with_the_parameters_of_one_gloo_run(runs):
    tmp, gloo = runs
    finals = [_final(tmp / f"demo-{s}" / "demo.jsonl") for s in SITES]
    want = gloo["logs"]["demo"]["final"][0]["params_sha256"]
    assert [f["params_sha256"] for f in finals] == [want, want]
    assert all(f["replicas_identical"] for f in finals)
    first = [json.loads(line) for line in (tmp / "demo-a" / "demo.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in first if r["kind"] == "step"] == [r["loss"] for r in gloo["logs"]["demo"]["step"]]


def test_each_site_records_its_participants_rounds_and_traffic(runs):
    tmp, _ = runs
    for site in SITES:
        store = _final(tmp / f"demo-{site}" / "demo.jsonl")["store"]
        assert [p["participant"] for p in store["participants"]] == [f"{site}.000", f"{site}.001"]
        assert store["missed_rounds"] == 0 and all(p["rounds"] == 5 for p in store["participants"])  # handshake + 4
        assert store["traffic"]["puts"] >= 10 and store["traffic"]["bytes_read"] > 0
        summary = json.loads((tmp / f"demo-{site}" / "summary.json").read_text())
        assert summary["site"]["site"] == site and summary["runs"][0]["workers"] == 4


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The two site commands with --sites 2 (FSDP2 over each site's 2 workers, shard k of one
    site exchanging with shard k of the other through the store), each in its own namespace
    where namespaces can be made, beside one 4-worker gloo run of 2 sites x 2 ranks."""
    tmp = tmp_path_factory.mktemp("sharded")
    env = train_env(THINWIRE_EXCHANGE_KEY=secrets.token_hex(32))
    return tmp, _site_pair_beside_gloo(tmp, [(env, ()), (env, ())], ("--sites", "2"))


def test_sites_sharded_by_fsdp2_end_with_the_parameters_of_one_two_tier_gloo_run(sharded):
    tmp, gloo = sharded
    finals = [_final(tmp / f"demo-{s}" / "demo.jsonl") for s in SITES]
    want = gloo["logs"]["demo"]["final"][0]["params_sha256"]
    assert [f["params_sha256"] for f in finals] == [want, want]
    first = [json.loads(line) for line in (tmp / "demo-a" / "demo.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in first if r["kind"] == "step"] == [r["loss"] for r in gloo["logs"]["demo"]["step"]]
    for site, final in zip(SITES, finals):
        assert final["tiers"]["ranks_per_site"] == 2 and final["store"]["missed_rounds"] == 0
        # each worker holds one shard and is its site in that shard's rounds
        assert [p["participant"] for p in final["store"]["participants"]] == [site, site]


@pytest.mark.parametrize("extra, env, message", [
    ((), {}, "--site needs the run's signing key"),
    (("--site", "c"), {"THINWIRE_EXCHANGE_KEY": "ab" * 32}, "--site c is not one of --peers a,b"),
    (("--peers", "a,a"), {"THINWIRE_EXCHANGE_KEY": "ab" * 32}, "--peers must name every site of the run once"),
    ((), {"THINWIRE_EXCHANGE_KEY": "not hex"}, "THINWIRE_EXCHANGE_KEY: the signing key must be hex"),
    ((), {"THINWIRE_EXCHANGE_KEY": "abcd"}, "at least 16 bytes"),
    (("--sites", "3"), {"THINWIRE_EXCHANGE_KEY": "ab" * 32}, "--sites with --site counts the run's sites: give --sites 2"),
    (("--optimizer", "adamw"), {"THINWIRE_EXCHANGE_KEY": "ab" * 32}, "adamw is a torch.distributed baseline"),
    (("--checkpoint-every", "2"), {"THINWIRE_EXCHANGE_KEY": "ab" * 32}, "--checkpoint-every with --site"),
])
def test_what_a_site_command_cannot_run_is_refused_before_any_worker_starts(extra, env, message, tmp_path,
                                                                           capsys, monkeypatch):
    monkeypatch.delenv("THINWIRE_EXCHANGE_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    store = tmp_path / "store"
    store.mkdir()
    argv = ["train", "--preset", "tiny", "--workers", "2", "--exchange", store.as_uri(), "--site", "a",
            "--peers", "a,b", "--out", str(tmp_path / "out"), *extra]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(store.iterdir())                         # nothing was written to the store


def test_sites_that_do_not_run_the_same_thing_are_refused_at_every_site_before_any_round(tmp_path, capsys):
    """agree() at two sites at once (threads: it runs before any worker starts), one given
    --steps 5: both refuse, naming the field and each value, and no round is written."""
    from thinwire.train.config import RunOptions, get_preset
    from thinwire.train.site_agree import agree
    opts = RunOptions(exchange=(tmp_path / "store").as_uri(), exchange_key="cd" * 32, peers=SITES)
    errors = {}

    def site(name: str, steps: int) -> None:
        try:
            agree(get_preset("tiny", steps=steps), {"demo": 1e-3}, replace(opts, site=name), 2, timeout=60)
        except ValueError as err:
            errors[name] = str(err)
    threads = [threading.Thread(target=site, args=args) for args in (("a", 4), ("b", 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "steps (here 4, b: 5)" in errors["a"] and "steps (here 5, a: 4)" in errors["b"]
    assert not list((tmp_path / "store").rglob("rounds"))
    agree(get_preset("tiny"), {"demo": 1e-3}, replace(opts, site="a", peers=("a", "c"), exchange_key="ef" * 32), 2,
          timeout=0.3)                                     # c never comes: a warning, and a goes on without it
    assert "site(s) c did not agree" in capsys.readouterr().err


def test_a_site_under_torchrun_without_a_store_is_refused(monkeypatch, tmp_path):
    """Under torchrun a --site is checked as the local launcher checks it (test_torchrun_sites.py runs one)."""
    from thinwire.train.cli import torchrun_main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="--site runs one site of a run whose sites share only a store"):
        torchrun_main(["--preset", "tiny", "--site", "a", "--peers", "a,b"])
