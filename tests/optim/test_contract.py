"""The contract suite, for DeMo (each transform, base and value format) and the dense
baseline, at world sizes 1-4 on real gloo process groups.

Expected byte counts come from the documented wire format and the chunk geometry of the
problem's shapes, derived by hand below, not from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist import run_workers
from tests.optim import contract, problem

DEMO = {"lr": 0.01, "topk": 8, "chunk": 16}
CONFIGS = {
    "demo": {"kind": "demo", "kwargs": DEMO},
    "demo-random": {"kind": "demo", "kwargs": {**DEMO, "transform": "random"}},
    "demo-identity": {"kind": "demo", "kwargs": {**DEMO, "transform": "identity"}},
    "demo-sgd": {"kind": "demo", "kwargs": {**DEMO, "lr": 0.1, "beta": 0.9, "base": "sgd"}},
    "demo-muon": {"kind": "demo", "kwargs": {**DEMO, "lr": 0.02, "base": "muon"}},
    "demo-fp32": {"kind": "demo", "kwargs": {**DEMO, "values": "fp32"}},
    "demo-int8": {"kind": "demo", "kwargs": {**DEMO, "values": "int8"}},
    "demo-sign": {"kind": "demo", "kwargs": {**DEMO, "values": "sign"}},
    "demo-param-domain": {"kind": "demo", "kwargs": {**DEMO, "momentum_domain": "param"}},
    "demo-senders-alpha": {"kind": "demo", "kwargs": {**DEMO, "aggregate": "senders", "alpha": 0.5}},
    "dense-adamw": {"kind": "dense-adamw"},
    "dense-sgd-bf16": {"kind": "dense-sgd", "kwargs": {"grad_dtype": torch.bfloat16}},
    "dense-muon": {"kind": "dense-muon"},
}
WORLDS = [1, 2, 3, 4]

# Chunk geometry with chunk=16 (see thinwire.compress.chunking): (num_chunks, elems_per_chunk)
#   weight1 (37, 24): 37 is prime -> padded to 48, 3 row chunks of 16; 24 -> divisor 12: 2 col chunks
#   bias1 (37,) -> (1, 37): padded to 48, 3 chunks of 1x16
#   weight2 (10, 37): 10 <= 16 one row chunk; 37 padded to 48, 3 col chunks of 16 -> 10x16
#   bias2 (10,) -> (1, 10): one chunk of 10
GEOMETRY = [(6, 16 * 12), (3, 16), (3, 10 * 16), (1, 10)]
HEADER = 8


def value_bytes(values: str, rows: int, cols: int) -> int:
    return {"fp32": 4 * rows * cols, "bf16": 2 * rows * cols, "int8": 4 * rows + rows * cols,
            "sign": 4 * rows + math.ceil(rows * cols / 8)}[values]


def demo_message_bytes(kwargs: dict) -> int:
    total = HEADER
    for chunks, elems in GEOMETRY:
        k = min(kwargs["topk"], elems)
        index_bits = max(1, math.ceil(math.log2(elems)))
        total += math.ceil(chunks * k * index_bits / 8) + value_bytes(kwargs.get("values", "bf16"), chunks, k)
    return total


def expected_step_counters(config: dict, world: int) -> dict:
    numel = sum(p.numel() for p in problem.make_model().parameters())
    if config["kind"] == "demo":
        n = demo_message_bytes(config["kwargs"])
        link = n * (world - 1)                                   # ring all-gather
    else:
        n = numel * (2 if config.get("kwargs", {}).get("grad_dtype") == torch.bfloat16 else 4)
        link = 2 * n * (world - 1) // world                      # ring all-reduce
    return {"payload_bytes": n, "link_bytes_sent": link, "link_bytes_received": link, "collectives": 1}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def outcome(request):
    world = request.param
    return world, run_workers(contract.run_contract, world, args=(CONFIGS,), timeout=600)


@pytest.mark.parametrize("name", CONFIGS)
def test_replicas_bit_identical(outcome, name):
    contract.assert_replicas_identical(*contract.per_rank(outcome, name))


@pytest.mark.parametrize("name", CONFIGS)
def test_resume_continues_bit_identically(outcome, name):
    contract.assert_resume_identical(contract.per_rank(outcome, name)[1])


@pytest.mark.parametrize("name", CONFIGS)
def test_bytes_counted_equal_wire_format(outcome, name):
    world, per_rank = contract.per_rank(outcome, name)
    expected = expected_step_counters(CONFIGS[name], world)
    handshake = {"payload_bytes": 8 if world > 1 else 0, "link_bytes_sent": 8 * (world - 1),
                 "link_bytes_received": 8 * (world - 1), "collectives": 1 if world > 1 else 0}
    for rank_result in per_rank:
        first, *rest = rank_result["counters"]
        assert first == {k: expected[k] + handshake[k] for k in expected}   # step 1 includes the handshake
        assert all(c == expected for c in rest)
        assert rank_result["by_tag"]["payload"] == {k: v * contract.STEPS for k, v in expected.items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_falls(outcome, name):
    contract.assert_loss_falls(contract.per_rank(outcome, name)[1])
