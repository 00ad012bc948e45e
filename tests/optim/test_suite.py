"""The one contract suite: every configuration of `registry.REGISTRY` (every public
optimizer, both EF21-Muon topologies, both DeMo momentum domains, APMSqueeze in both
phases, LoRDO, DiLoCo, the dense baselines) on real gloo groups of 1, 2 and 3 ranks.

Expected bytes come from the documented wire formats (registry.py), derived by hand.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_workers
from tests.optim.registry import APM_WARMUP, REGISTRY, expected_payload
from tests.optim.suite import BAD_STEP, RESUME_AT, STEPS, run_suite

NAMES = list(REGISTRY)
WORLDS = [1, 2, 3]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def outcome(request):
    world = request.param
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return 1, [run_suite(0, 1, NAMES)]
        finally:
            torch.set_num_threads(threads)
    return world, run_workers(run_suite, world, args=(NAMES,), timeout=900)


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
    return (step + 1) % REGISTRY[name].every == 0


@pytest.mark.parametrize("name", NAMES)
def test_replicas_bit_identical(outcome, name):
    identical(*ranks_of(outcome, name, "run"))


@pytest.mark.parametrize("name", NAMES)
def test_resume_bit_identical_fp32(outcome, name):
    for r in ranks_of(outcome, name, "run")[1]:
        assert torch.equal(r["resumed"], r["params"])


@pytest.mark.parametrize("name", NAMES)
def test_resume_bit_identical_bf16_and_state_keeps_its_dtype(outcome, name):
    world, ranks = ranks_of(outcome, name, "bf16")
    identical(world, ranks)
    for r in ranks:
        assert torch.equal(r["resumed"], r["params"])
        saved, loaded = r["state_dtypes"]
        assert loaded == saved


@pytest.mark.parametrize("name", NAMES)
def test_loss_falls_on_every_rank(outcome, name):
    for r in ranks_of(outcome, name, "run")[1]:
        assert r["loss_after"] < 0.8 * r["loss_before"], (r["loss_before"], r["loss_after"])


@pytest.mark.parametrize("name", NAMES)
def test_bytes_equal_the_wire_format(outcome, name):
    world, ranks = ranks_of(outcome, name, "run")
    for rank, r in enumerate(ranks):
        expected = expected_payload(name, world, r["shapes"])
        previous = {}
        for step, (status, by_tag) in enumerate(r["log"]):
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


@pytest.mark.parametrize("name", NAMES)
def test_lambda_lr_warmup_from_zero_moves_nothing_then_trains(outcome, name):
    world, ranks = ranks_of(outcome, name, "lambda_warmup")
    identical(world, ranks)
    for r in ranks:
        assert r["unmoved"]
        assert r["loss_after"] < r["loss_before"]


@pytest.mark.parametrize("name", NAMES)
def test_one_cycle_lr_trains(outcome, name):
    world, ranks = ranks_of(outcome, name, "one_cycle")
    identical(world, ranks)
    for r in ranks:
        assert set(r["statuses"]) == {"ok"}
        assert r["loss_after"] < r["loss_before"]


@pytest.mark.parametrize("name", NAMES)
def test_add_param_group_trains_the_added_parameters(outcome, name):
    world, ranks = ranks_of(outcome, name, "add_param_group")
    identical(world, ranks)
    assert all(all(r["moved"]) for r in ranks)


@pytest.mark.parametrize("name", NAMES)
def test_closure_loss_is_returned(outcome, name):
    for r in ranks_of(outcome, name, "closure")[1]:
        assert r["loss"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["moved"]


def _flagged_step(name: str) -> int:
    """Where every rank learns of the bad gradient: the step itself, or the next sync
    (overlap: the step() after it)."""
    every = REGISTRY[name].every
    return (BAD_STEP // every + 1) * every - 1 + REGISTRY[name].delay


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_raise_on_every_rank_then_continue(outcome, name):
    world, ranks = ranks_of(outcome, name, "nonfinite_raise")
    flagged = _flagged_step(name)
    for r in ranks:
        assert r["statuses"][flagged] == "NonFiniteGradientError", r["statuses"]
        assert all(s == "ok" for i, s in enumerate(r["statuses"]) if i != flagged), r["statuses"]
        if REGISTRY[name].every == 1:
            assert r["unmoved"][flagged]
    identical(world, ranks)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_skip_moves_nobody(outcome, name):
    world, ranks = ranks_of(outcome, name, "nonfinite_skip")
    for rank, r in enumerate(ranks):
        assert set(r["statuses"]) == {"ok"}
        if REGISTRY[name].every == 1 or rank == world - 1:     # the bad rank's local step is skipped too
            delay = REGISTRY[name].delay if REGISTRY[name].every == 1 else 0   # a local step is not delayed
            assert r["unmoved"][BAD_STEP + delay]
    identical(world, ranks)


@pytest.mark.parametrize("name", NAMES)
def test_frozen_unused_and_empty_parameters(outcome, name):
    world, ranks = ranks_of(outcome, name, "frozen_and_unused")
    identical(world, ranks)
    for r in ranks:
        assert r["frozen"] and r["unused"] and r["trained"]


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_parameters(outcome, name):
    world, ranks = ranks_of(outcome, name, "non_contiguous")
    identical(world, ranks)
    assert all(r["moved"] and r["finite"] for r in ranks)


@pytest.mark.parametrize("name", NAMES)
def test_bad_peers_fail_on_every_rank(outcome, name):
    world, results = outcome
    if world == 1:
        pytest.skip("needs peers")
    for r in ranks_of(outcome, name, "bad_peers")[1]:
        assert r["shapes"] == "PeerMismatchError"
        assert r["lockstep"][0] == "PeerMismatchError"
