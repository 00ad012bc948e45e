"""DeMo and SparseLoCo through the store exchange: 2 sites as 2 processes sharing only a
file:// store, against the same 2 processes over gloo.

On time, every parameter and every state tensor is bit-identical to the gloo run. With one
site sleeping past the round deadline, the round closes without it: both sites apply the
other's message alone and stay bit-identical, and the late site keeps its message (DeMo in
M, SparseLoCo in e), which is what separates it from the on-time run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import thinwire
from thinwire.compress import SparseLoCoTopK
from thinwire.store import StoreGroup

from .conftest import CREDENTIALS, make_bucket
from .train_sites import CONFIG, KEY, SITES, run_gloo, run_store

ON_TIME_S = 60.0         # no site misses a round
TIMEOUT_S = 3.0          # the late runs' round_timeout
LATE_S = 4.5             # past the deadline, and back within the next round's
KINDS = ["demo", "demo-bf16", "demo-overlap", "sparseloco", "sparseloco-2bit", "sparseloco-flat", "diloco-bf16",
         "diloco-int8", "sign-demo"]
SYNCS = ["sparseloco", "sparseloco-2bit", "sparseloco-flat", "diloco-bf16", "diloco-int8"]
EVERY_STEP = ("demo", "sign-demo")                # an exchange every step
LATE = {**{kind: (1, 3) for kind in EVERY_STEP}, **{kind: (1, 4) for kind in SYNCS}}
ROUND_OF = {**{kind: 3 for kind in EVERY_STEP}, **{kind: 2 for kind in SYNCS}}
KEPT_IN = {"demo": "momentum", "sparseloco": "error", "diloco": "sync_error", "sign": "momentum"}
# LATE: (rank, step): site-b at a DeMo step, at a SparseLoCo sync; ROUND_OF: that step's round
# (round 0 is the handshake; SparseLoCo syncs every 2nd step)
EXACT = ("demo", "sparseloco")                     # fp32 values: what the late site kept is exact


def tensors(entry: dict) -> list[torch.Tensor]:
    return entry["params"] + [t for state in entry["state"] for t in state.values()]


def assert_identical(left: list[dict], right: list[dict]) -> None:
    for a, b in zip(left, right, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """kind -> (gloo run, on-time store run)."""
    def both(kind):
        url = tmp_path_factory.mktemp(kind).as_uri()
        return run_gloo(kind), run_store(kind, url, ON_TIME_S)
    return {kind: both(kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_on_time_store_run_is_bit_identical_to_gloo(runs, kind):
    gloo, store = runs[kind]
    for rank in range(len(SITES)):
        assert_identical(gloo[rank]["history"], store[rank]["history"])
        assert store[rank]["missed"] == []
        assert store[rank]["stats"]["payload_bytes"] == gloo[rank]["stats"]["payload_bytes"]
    last = [store[r]["history"][-1]["params"] for r in range(len(SITES))]    # replicas, after a sync
    assert all(torch.equal(x, y) for x, y in zip(*last, strict=True))


def test_demo_through_an_s3_api_server_is_bit_identical_to_gloo(runs, s3_endpoint):
    options = {"endpoint": s3_endpoint, **CREDENTIALS}
    store = run_store("demo", f"s3://{make_bucket(s3_endpoint)}/run-1", ON_TIME_S, options=options)
    gloo, _ = runs["demo"]
    for rank in range(len(SITES)):
        assert_identical(gloo[rank]["history"], store[rank]["history"])
        assert store[rank]["missed"] == []


@pytest.fixture(scope="module")
def late_runs(tmp_path_factory):
    def late(kind):
        rank, step = LATE[kind]
        return run_store(kind, tmp_path_factory.mktemp(f"late-{kind}").as_uri(), TIMEOUT_S, (rank, step, LATE_S))
    with ThreadPoolExecutor(max_workers=3) as pool:       # the sites mostly sleep and poll: run 3 at once
        return dict(zip(LATE, pool.map(late, LATE)))


def held_back(kind: str, late: torch.Tensor, on_time: torch.Tensor) -> int:
    """How many elements of the late site's state differ from the on-time run's: where its
    message was taken out and went back in. Exact (fp32 values): zero in the on-time run
    (x - x) there. SparseLoCo 2-bit: at most the values its message carries. DiLoCo bf16:
    the on-time run keeps x - bf16(x), the late one x itself."""
    differs = late != on_time
    assert differs.any()
    if kind in EXACT:
        assert (on_time[differs] == 0).all()
    elif kind == "diloco-bf16":
        assert torch.equal(on_time, late - late.bfloat16().float())
    elif kind.startswith("sparseloco"):
        compressor = SparseLoCoTopK(topk=4, chunk=8)                  # train_sites' settings
        plan = compressor.plan(on_time.shape)
        assert int(differs.sum()) <= compressor.k(on_time.shape) * plan.padded_numel // plan.chunk_elems
    return int(differs.sum())


@pytest.mark.parametrize("kind", list(LATE))
def test_a_late_site_is_left_out_and_keeps_its_message(runs, late_runs, kind):
    _, on_time = runs[kind]
    sites = late_runs[kind]
    rank, step = LATE[kind]
    at, key = step - 1, KEPT_IN[kind.split("-")[0]]                  # history index of `step`; what keeps it
    assert sites[rank]["missed"] == [ROUND_OF[kind]] and sites[1 - rank]["missed"] == []
    for i, (a, b) in enumerate(zip(sites[0]["history"], sites[1]["history"], strict=True)):   # replicas
        if kind in EVERY_STEP or i % 2:                                 # every DeMo step, every sync
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        if kind not in EVERY_STEP:                                      # θ₀, every step
            assert all(torch.equal(x["anchor"], y["anchor"]) for x, y in zip(a["state"], b["state"], strict=True))
    for r in range(len(SITES)):                                         # nothing differs before the late round
        assert_identical(sites[r]["history"][:at], on_time[r]["history"][:at])
    late = [s[key] for s in sites[rank]["history"][at]["state"]]
    on_time_state = [s[key] for s in on_time[rank]["history"][at]["state"]]
    assert sum(held_back(kind, x, y) for x, y in zip(late, on_time_state, strict=True))
    other = [s[key] for s in sites[1 - rank]["history"][at]["state"]]   # the on-time site's sent as always
    assert all(torch.equal(x, s[key]) for x, s in zip(other, on_time[1 - rank]["history"][at]["state"]))
    # the on-time site's message alone moved the replicas: not where both messages moved them
    assert not all(torch.equal(x, y) for x, y in zip(sites[0]["history"][at]["params"],
                                                    on_time[0]["history"][at]["params"]))


def test_optimizers_that_cannot_keep_a_missed_message_refuse_the_store(tmp_path):
    group = StoreGroup(tmp_path.as_uri(), SITES[0], SITES, KEY, CONFIG)
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    makes = {"DiLoCo": lambda: thinwire.DiLoCo(params, process_group=group),          # wire='fp32': all_reduce
             "LoRDO": lambda: thinwire.LoRDO(params, process_group=group),
             "DenseAllReduce": lambda: thinwire.DenseAllReduce(torch.optim.SGD(params), process_group=group),
             "APMSqueeze": lambda: thinwire.APMSqueeze(params, lr=1e-3, warmup_steps=10, process_group=group),
             "EF21Muon": lambda: thinwire.EF21Muon(params, process_group=group)}
    for name, make in makes.items():
        with pytest.raises(ValueError, match=f"{name} cannot exchange through the store"):
            make()


def test_the_first_handshake_closes_without_a_site_that_is_not_there(tmp_path):
    """Alone in a 2-site run, a site's first step waits join_timeout for the other at the
    handshake round, then goes on without it (it joins later); after `patience` late rounds
    the missing site is presumed gone."""
    group = StoreGroup(tmp_path.as_uri(), SITES[0], SITES, KEY, CONFIG, 0.2, join_timeout=0.2, patience=2,
                       poll=(0.01, 0.05))
    param = torch.nn.Parameter(torch.ones(8, 8))
    opt = thinwire.DeMo([param], topk=4, chunk=8, process_group=group)
    param.grad = torch.ones(8, 8)
    opt.step()
    assert [r.late for r in group.results] == [("site-b",), ("site-b",)]
    assert group.missed_rounds == [] and group.results[0].gone == () and group.results[1].gone == ("site-b",)
    assert not torch.equal(param, torch.ones(8, 8))                 # its own message alone moved it


@pytest.fixture(scope="module")
def asleep(tmp_path_factory):
    """The runs below, which mostly sleep past deadlines, three at once: the late site with a
    non-finite gradient, and a site two rounds behind (DeMo, with and without overlap)."""
    def run(what):
        url = tmp_path_factory.mktemp(f"asleep-{what}").as_uri()
        if what == "nan":
            rank, step = LATE["demo"]
            return run_store("demo", url, TIMEOUT_S, (rank, step, LATE_S, "nan"), raises=True)
        return run_store(what, url, TIMEOUT_S, (1, 2, 2.5 * TIMEOUT_S), patience=3)   # still awaited at round 4
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(("nan", "demo", "demo-overlap"), pool.map(run, ("nan", "demo", "demo-overlap"))))


def test_a_late_site_with_nonfinite_gradients_stops_and_the_other_goes_on(asleep):
    """Nobody saw the late site's flag: the other site applied the step without it, so the
    late one has nothing to keep and cannot follow; it raises, the other finishes."""
    rank, _ = LATE["demo"]
    sites = asleep["nan"]
    assert isinstance(sites[rank], str) and "NonFiniteGradientError" in sites[rank]
    assert "missed the store round" in sites[rank]
    assert len(sites[1 - rank]["history"]) == 4 and sites[1 - rank]["missed"] == []


@pytest.mark.parametrize("kind", ["demo", "demo-overlap"])
def test_a_site_two_rounds_behind_catches_up_from_their_manifests(asleep, kind):
    """Asleep past two deadlines: it finds both rounds closed, applies what their manifests
    hold, keeps both its messages, and is back in the third (DeMo with overlap: two rounds in
    flight while it catches up). patience=3: the other site still waits for it in the third
    round (with 2 it would be presumed gone there: tests/store/test_membership.py)."""
    rank, sites = 1, asleep[kind]                               # asleep at step 2, for 2.5 deadlines
    assert sites[rank]["missed"] == [2, 3] and sites[1 - rank]["missed"] == []
    for a, b in zip(sites[0]["history"], sites[1]["history"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
