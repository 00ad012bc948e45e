"""The one contract suite: every configuration of `registry.REGISTRY` (every public
optimizer, both EF21-Muon topologies, both DeMo momentum domains, APMSqueeze in both
phases, LoRDO, DiLoCo, the dense baselines) on real gloo groups of 1, 2 and 3 ranks; and
the options they leave at their defaults, `registry.VARIANTS` (APMSqueeze resumed inside
its warmup and without bias correction; LoRDO's int8 and bf16 wires, outer momentum, no
error feedback; DiLoCo's SGD inner, bf16 and int8 wires; EF21-Muon's Top-K, Rand-K,
DCT-Top-K and rank-K compressors), 50-step runs at the world sizes each lists (1 to 4).

Expected bytes come from the documented wire formats (registry.py), derived by hand.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.optim.registry import APM_WARMUP, CONFIGS, HANDSHAKE, REGISTRY, all_gather, expected_payload, link, plus
from tests.optim.suite import BAD_STEP, CASES, on_world, run_suite

NAMES = list(REGISTRY)


def runs(case: str, names=CONFIGS) -> list:
    """(world, name) for every world a configuration runs `case` at, world by world."""
    worlds = sorted({w for c in CONFIGS.values() for w in c.worlds})
    return [pytest.param(w, n, id=f"world{w}-{n}") for w in worlds for n in names
            if w in CONFIGS[n].worlds and case in (CONFIGS[n].cases or CASES) and not (case == "bad_peers" and w == 1)]


@pytest.fixture(scope="module")
def suite_at(request):
    """suite_at(world) -> (world, [run_suite's results per rank]) for every configuration that
    runs at that world size: one spawn per world. When a test first needs one, every world this
    session's tests need starts at once, the spawned ones beside the world of one this process
    runs (alone, that one keeps one core busy). The whole suite is paid by the first test that
    asks: about 170 s of CPU for worlds 1-4 (world 1 ~15 s here, each rank of worlds 2 and 3
    ~25-30 s), so about 90 s on 2 quiet cores, CPU-bound."""
    mine = [item for item in request.session.items if item.module is request.module and hasattr(item, "callspec")]
    worlds = sorted({item.callspec.params["world"] for item in mine if "world" in item.callspec.params})

    def result(world):
        try:
            return on_world(run_suite, world, [n for n, c in CONFIGS.items() if world in c.worlds])
        except Exception as exc:  # every test of this world fails with it, none spawns again
            return exc

    pool = ThreadPoolExecutor(max(1, len(worlds)))
    started = {w: pool.submit(result, w) for w in worlds if w > 1}
    pool.shutdown(wait=False)
    done = {}

    def at(world):
        if world not in done:
            done[world] = started[world].result() if world in started else result(world)
        if isinstance(done[world], Exception):
            pytest.fail(f"the suite at world size {world} failed: {done[world]}", pytrace=False)
        return world, done[world]
    return at


@pytest.fixture
def outcome(suite_at, world):
    return suite_at(world)


def ranks_of(outcome, name: str, case: str) -> tuple[int, list]:
    world, results = outcome
    ranks = [r[(name, case)] for r in results]
    errors = [r["error"] for r in ranks if isinstance(r, dict) and "error" in r]
    assert not errors, errors[0]
    return world, ranks


def identical(world: int, ranks: list, key: str = "params") -> None:
    for r in range(1, world):
        assert torch.equal(ranks[r][key], ranks[0][key]), f"rank {r} drifted from rank 0"


def is_exchange(name: str, step: int) -> bool:
    return (step + 1) % CONFIGS[name].every == 0


@pytest.mark.parametrize("world, name", runs("run"))
def test_replicas_bit_identical(outcome, name):
    identical(*ranks_of(outcome, name, "run"))


@pytest.mark.parametrize("world, name", runs("run", [n for n, c in CONFIGS.items() if c.delay]))
def test_state_dict_leaves_a_run_with_an_exchange_in_flight_alone(outcome, name):
    """state_dict() half way, with a step's exchange in flight (overlap=True), changes nothing:
    the run ends bit for bit where the same run without it ends."""
    for r in ranks_of(outcome, name, "run")[1]:
        assert torch.equal(r["params"], r["undisturbed"])


@pytest.mark.parametrize("world, name", runs("run"))
def test_resume_bit_identical_fp32(outcome, name):
    world, ranks = ranks_of(outcome, name, "run")
    for r in ranks:
        assert torch.equal(r["resumed"], r["params"])
        # the counters carry over through the checkpoint and count what the resumed process
        # hands to torch.distributed (a world of one hands nothing over): its new handshake
        # and, with a step in flight at the checkpoint, that step's message sent again
        assert world == 1 or r["resumed_counted"] == r["resumed_handed"]
        resumed = {tag: c for tag, c in r["resumed_by_tag"].items() if tag != "handshake"}
        whole = {tag: c for tag, c in r["by_tag"].items() if tag != "handshake"}
        if not CONFIGS[name].delay:
            assert resumed == whole
        else:      # the re-sent message added (none when nothing was in flight, or ReduceAll's saved sum)
            assert resumed.keys() == whole.keys()
            assert all(resumed[t]["payload_bytes"] >= whole[t]["payload_bytes"] for t in whole)


@pytest.mark.parametrize("world, name", runs("bf16"))
def test_resume_bit_identical_bf16_and_state_keeps_its_dtype(outcome, name):
    world, ranks = ranks_of(outcome, name, "bf16")
    identical(world, ranks)
    for r in ranks:
        assert torch.equal(r["resumed"], r["params"])
        saved, loaded = r["state_dtypes"]
        assert loaded == saved


@pytest.mark.parametrize("world, name", runs("run"))
def test_loss_falls_on_every_rank(outcome, name):
    ratio = CONFIGS[name].loss_ratio
    for r in ranks_of(outcome, name, "run")[1]:
        assert r["loss_after"] < ratio * r["loss_before"], (r["loss_before"], r["loss_after"])


@pytest.mark.parametrize("world, name", runs("run", NAMES))
def test_bytes_equal_the_wire_format(outcome, name):
    world, ranks = ranks_of(outcome, name, "run")
    for rank, r in enumerate(ranks):
        expected = expected_payload(name, world, r["shapes"])
        previous = {}
        for step, (status, by_tag, _) in enumerate(r["log"]):
            assert status == "ok"
            for tag, nbytes in expected.items():
                now = by_tag.get(tag, {}).get("payload_bytes", 0)
                sent = now - previous.get(tag, {}).get("payload_bytes", 0)
                if name.startswith("apmsqueeze-compressed") and step < APM_WARMUP + REGISTRY[name].delay:
                    continue                                   # the dense warmup steps (overlap: and the
                                                               # first 1-bit one, whose phase 2 lands a step later)
                if tag == "downlink" and rank != 0:
                    nbytes = 0                                 # a broadcast's payload is the root's
                assert sent == (nbytes if is_exchange(name, step) else 0), (step, tag)
            previous = by_tag
        handshake = r["log"][0][1].get("handshake", {}).get("payload_bytes", 0)
        assert handshake == (8 if world > 1 else 0)


@pytest.mark.parametrize("world, name", runs("run", [n for n, c in CONFIGS.items() if c.counters]))
def test_every_steps_counters_equal_the_wire_format(outcome, name):
    """Per step and per tag: payload bytes, link bytes sent and received, collectives (the
    handshake's too); and the step's own counters, their sum."""
    world, ranks = ranks_of(outcome, name, "run")
    zero = link(0, 0, 0, 0)
    for rank, r in enumerate(ranks):
        previous = {}
        for step, (status, by_tag, last_step) in enumerate(r["log"]):
            assert status == "ok"
            expected = CONFIGS[name].counters(world, rank, step, r["shapes"]) if is_exchange(name, step) else {}
            if step == 0 and world > 1:
                expected = {**expected, "handshake": all_gather(HANDSHAKE, world)}
            for tag in {*by_tag, *expected}:
                was = previous.get(tag, zero)
                sent = {key: v - was[key] for key, v in by_tag.get(tag, zero).items()}
                assert sent == expected.get(tag, zero), (step, tag)
            assert last_step == plus(zero, *expected.values()), step
            previous = by_tag


@pytest.mark.parametrize("world, name", runs("lambda_warmup"))
def test_lambda_lr_warmup_from_zero_moves_nothing_then_trains(outcome, name):
    world, ranks = ranks_of(outcome, name, "lambda_warmup")
    identical(world, ranks)
    for r in ranks:
        assert r["unmoved"]
        assert r["loss_after"] < r["loss_before"]


@pytest.mark.parametrize("world, name", runs("one_cycle"))
def test_one_cycle_lr_trains(outcome, name):
    world, ranks = ranks_of(outcome, name, "one_cycle")
    identical(world, ranks)
    for r in ranks:
        assert set(r["statuses"]) == {"ok"}
        assert r["loss_after"] < r["loss_before"]


@pytest.mark.parametrize("world, name", runs("add_param_group"))
def test_add_param_group_trains_the_added_parameters(outcome, name):
    world, ranks = ranks_of(outcome, name, "add_param_group")
    identical(world, ranks)
    assert all(all(r["moved"]) for r in ranks)


@pytest.mark.parametrize("world, name", runs("closure"))
def test_closure_loss_is_returned(outcome, name):
    for r in ranks_of(outcome, name, "closure")[1]:
        assert r["loss"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["moved"]


def _flagged_step(name: str) -> int:
    """Where every rank learns of the bad gradient: the step itself, or the next sync
    (overlap: the step() after it)."""
    every = REGISTRY[name].every
    return (BAD_STEP // every + 1) * every - 1 + REGISTRY[name].delay


@pytest.mark.parametrize("world, name", runs("nonfinite_raise"))
def test_nonfinite_raise_on_every_rank_then_continue(outcome, name):
    world, ranks = ranks_of(outcome, name, "nonfinite_raise")
    flagged = _flagged_step(name)
    for r in ranks:
        assert r["statuses"][flagged] == "NonFiniteGradientError", r["statuses"]
        assert all(s == "ok" for i, s in enumerate(r["statuses"]) if i != flagged), r["statuses"]
        if REGISTRY[name].every == 1:
            assert r["unmoved"][flagged]
    identical(world, ranks)


@pytest.mark.parametrize("world, name", runs("nonfinite_skip"))
def test_nonfinite_skip_moves_nobody(outcome, name):
    world, ranks = ranks_of(outcome, name, "nonfinite_skip")
    for rank, r in enumerate(ranks):
        assert set(r["statuses"]) == {"ok"}
        if REGISTRY[name].every == 1 or rank == world - 1:     # the bad rank's local step is skipped too
            delay = REGISTRY[name].delay if REGISTRY[name].every == 1 else 0   # a local step is not delayed
            assert r["unmoved"][BAD_STEP + delay]
    identical(world, ranks)


@pytest.mark.parametrize("world, name", runs("frozen_and_unused"))
def test_frozen_unused_and_empty_parameters(outcome, name):
    world, ranks = ranks_of(outcome, name, "frozen_and_unused")
    identical(world, ranks)
    for r in ranks:
        assert r["frozen"] and r["unused"] and r["trained"]


@pytest.mark.parametrize("world, name", runs("non_contiguous"))
def test_non_contiguous_parameters(outcome, name):
    world, ranks = ranks_of(outcome, name, "non_contiguous")
    identical(world, ranks)
    assert all(r["moved"] and r["finite"] for r in ranks)


@pytest.mark.parametrize("world, name", runs("bad_peers"))
def test_bad_peers_fail_on_every_rank(outcome, name):
    for r in ranks_of(outcome, name, "bad_peers")[1]:
        assert r["shapes"] == "PeerMismatchError"
        assert r["lockstep"][0] == "PeerMismatchError"
