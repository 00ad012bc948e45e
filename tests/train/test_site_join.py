"""--snapshot-every and --join: what they refuse before any worker starts, and a joiner
starting from the snapshot live sites wrote (sites as processes sharing only a folder; and
as `thinwire train` commands whose workers FSDP2 shards, each shard its own snapshots)."""

from __future__ import annotations

import json
import secrets
import sys

import pytest
import torch

import thinwire
from tests.store.train_sites import run_processes
from tests.train.shared import start, train_env, wait
from thinwire.train.config import RunOptions
from thinwire.train.site_join import check_join, join, publish

URL = "file:///tmp/thinwire-never-written"


@pytest.mark.parametrize("fields, optimizers, message", [
    (dict(snapshot_every=-1, exchange=URL), ["demo"], r"--snapshot-every must be an int >= 0"),
    (dict(snapshot_every=True, exchange=URL), ["demo"], r"--snapshot-every must be an int >= 0"),
    (dict(snapshot_every=5), ["demo"], r"--snapshot-every writes snapshots to the store: give --exchange"),
    (dict(join=True, exchange=URL), ["demo"], r"--join .* give --exchange URL and --site"),
    (dict(join_timeout=0.0, exchange=URL), ["demo"], r"--join-timeout must be > 0"),
    (dict(snapshot_every=5, exchange=URL), ["demo", "demo-overlap"], r"demo-overlap keeps a step's exchange"),
])
def test_bad_snapshot_and_join_options_are_refused(fields, optimizers, message):
    with pytest.raises(ValueError, match=message):
        check_join(RunOptions(**fields), optimizers)


def test_snapshots_and_joining_pass_the_check_where_they_can_run():
    check_join(RunOptions(exchange=URL, snapshot_every=5), ["demo", "sparseloco"])
    check_join(RunOptions(exchange=URL, site="c", peers=("a", "b", "c"), join=True), ["demo"])
    check_join(RunOptions(), ["adamw"])


KEY, CONFIG = b"the join test's key", '{"test": "harness join"}'
SITES = ["a.000", "b.000", "c.000"]          # c is declared but joins later


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _built(url: str, site: str, seed: int):
    from thinwire.store import StoreGroup
    model = _model(seed)
    group = StoreGroup(url, site, SITES, KEY, CONFIG, round_timeout=0.3, join_timeout=0.5, poll=(0.01, 0.05))
    opt = thinwire.DeMo(model.parameters(), lr=1e-2, topk=4, chunk=8, process_group=group)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    return model, group, opt, sched


def _live_site(tmpdir: str, i: int, url: str) -> None:
    """Sites a and b: 4 steps, the harness's snapshot after each (every 2 rounds)."""
    model, group, opt, sched = _built(url, SITES[i], seed=0)
    options = RunOptions(exchange=url, snapshot_every=2)
    for step in range(1, 5):
        data = torch.Generator().manual_seed(100 * i + step)
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 8, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        publish(options, group, model, opt, sched, step, rank=0)
    torch.save(("ok", [p.detach().clone() for p in model.parameters()]), f"{tmpdir}/result{i}.pt")


def test_a_joiner_starts_from_the_live_sites_snapshot(tmp_path):
    """Two live sites write snapshots through the harness's `publish`; a third, declared but
    absent, `join`s: the live sites' parameters, their step and schedule, the round after the
    snapshot's, and its own momentum from zero."""
    url = tmp_path.as_uri()
    outcomes = run_processes(_live_site, [(url,), (url,)], timeout=120.0)
    assert all(isinstance(o, tuple) and o[0] == "ok" for o in outcomes), outcomes
    final = outcomes[0][1]
    assert all(torch.equal(x, y) for x, y in zip(final, outcomes[1][1], strict=True))
    model, group, opt, sched = _built(url, "c.000", seed=1)         # another initial model
    record = join(RunOptions(exchange=url, site="c", join=True), group, model, opt, sched, timeout_s=10.0)
    assert record == {"kind": "join", "round": 4, "step": 4}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), final, strict=True))
    assert sched.last_epoch == 4 and group.next_round == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 5)
    momenta = [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.numel() > 1]
    assert momenta and all(not t.any() for t in momenta)       # per-rank state starts from zero


def test_join_gives_up_when_no_snapshot_comes(tmp_path):
    model, group, opt, sched = _built(tmp_path.as_uri(), "c.000", seed=1)
    with pytest.raises(RuntimeError, match=r"--join: no snapshot of this run .* --snapshot-every"):
        join(RunOptions(exchange=tmp_path.as_uri(), site="c", join=True), group, model, opt, sched, timeout_s=0.2)


def test_a_joiners_log_times_its_target_from_its_first_step():
    """A site that joined at step 3 logs steps 4-6: its time to target counts from step 4."""
    from thinwire.train.report import cumulative_times, time_to_target
    steps = [{"step": s, "step_s": 1.0, "comm_s": 0.0, "link_bytes_sent": 0, "link_bytes_received": 0,
              "collectives": 1} for s in (4, 5, 6)]
    evals = [{"step": 4, "val_loss": 3.0}, {"step": 6, "val_loss": 2.0}]
    times = cumulative_times(steps, 0.0)
    assert time_to_target(evals, times, 2.5, first_step=4)["measured"] == 3.0     # steps 4, 5 and 6
    assert time_to_target(evals, times, 3.5, first_step=4)["measured"] == 1.0


SHARDED = ("train", "--preset", "tiny", "--optimizer", "demo", "--workers", "2", "--sites", "3", "--steps", "10",
           "--eval-every", "10", "--eval-rows", "16", "--no-adamw-probe", "--peers", "a,b,c", "--snapshot-every", "2",
           "--join-timeout", "3", "--round-timeout", "5", "--quiet")


def _digests(out) -> tuple[list[dict], dict[int, str]]:
    records = [json.loads(line) for line in (out / "demo.jsonl").read_text().splitlines()]
    return records, {r["step"]: r["params_sha256"] for r in records if r["kind"] == "step"}


def test_a_site_sharded_by_fsdp2_joins_from_its_shards_snapshots(tmp_path):
    """Sites a and b (2 workers each, FSDP2 inside, paced at 0.5 s a step) write each shard's
    snapshot every 2 rounds; c, started with them, waits in `join` for the first snapshot while
    a and b's first round waits out --join-timeout without it, then joins: its log starts with
    the join, and from then on every step ends with the parameters a and b have after it (each
    step's digest: the logging rank's shard, the same shard at every site; the final one: the
    whole model)."""
    store, env = tmp_path / "store", train_env(THINWIRE_EXCHANGE_KEY=secrets.token_hex(32), THINWIRE_STEP_SLEEP="0.5",
                                               THINWIRE_STEP_DIGEST="1")
    argv = [sys.executable, "-m", "thinwire", *SHARDED, "--exchange", store.as_uri()]
    live = [start([*argv, "--site", s, "--out", str(tmp_path / s)], env=env) for s in ("a", "b")]
    joiner = start([*argv, "--site", "c", "--join", "--out", str(tmp_path / "c")], env=env)
    for proc in (*live, joiner):
        done = wait(proc, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
    (a_log, a), (_, b), (c_log, c) = (_digests(tmp_path / s) for s in ("a", "b", "c"))
    joined = c_log[0]
    assert joined["kind"] == "join" and joined["round"] % 2 == 0 and 2 <= joined["step"] < 10
    assert sorted(c) == list(range(joined["step"] + 1, 11)) and a == b
    assert all(c[step] == a[step] for step in c)
    assert c_log[-1]["params_sha256"] == a_log[-1]["params_sha256"]
