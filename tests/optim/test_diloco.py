"""DiLoCo on real gloo groups (world sizes 1 and 2): against an independent simulation of W
workers (torch AdamW inner, Nesterov outer written from the equations), the contract suite
adapted to infrequent syncs (replicas compared after the final sync at step 50), byte
counts, bad peers and bad arguments.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import outcome_of
from tests.optim import contract, problem
from thinwire.optim.diloco import DiLoCo


def make_diloco(params, inner_lr=0.03, inner="adamw", **kwargs):
    if inner == "sgd":
        return DiLoCo(params, inner=lambda ps: torch.optim.SGD(ps, lr=inner_lr, momentum=0.9), **kwargs)
    return DiLoCo(params, inner=lambda ps: torch.optim.AdamW(ps, lr=inner_lr), **kwargs)


CONFIGS = {
    "diloco": {"factory": make_diloco, "kwargs": {"sync_every": 10}},
    "diloco-sgd": {"factory": make_diloco, "kwargs": {"sync_every": 10, "inner": "sgd", "inner_lr": 0.05}},
    "diloco-bf16": {"factory": make_diloco, "kwargs": {"sync_every": 10, "wire": "bf16"}},
}
H, OUTER_LR, OUTER_MOMENTUM, SIM_STEPS = 4, 0.7, 0.9, 12
WORLDS = [1, 2]
NUMEL = sum(p.numel() for p in problem.make_model().parameters())




def _bad_peers(rank, world):
    p = torch.nn.Parameter(torch.randn(4, 4 if rank == 0 else 5))
    opt = DiLoCo([p], sync_every=1)
    p.grad = torch.randn_like(p)
    mismatch = outcome_of(opt.step)
    q = torch.nn.Parameter(torch.randn(6))
    opt = DiLoCo([q], sync_every=2)
    nan = []
    for step in range(2):
        q.grad = torch.full_like(q, float("nan") if (step == 1 and rank == world - 1) else 1.0)
        nan.append(outcome_of(opt.step)[0])
    return mismatch, nan


def _simulated_run(rank):
    model = problem.make_model()
    opt = make_diloco(list(model.parameters()), inner_lr=0.01, sync_every=H)
    contract.train({"factory": lambda ps: opt}, rank, 0, SIM_STEPS, model, opt)
    return problem.flat_params(model)


def suite(rank, world, configs):
    return {"bad": _bad_peers(rank, world) if world > 1 else None, "sim": _simulated_run(rank),
            "contract": contract.run_contract(rank, world, configs)}


outcome = contract.suite_fixture(suite, CONFIGS, WORLDS)


@pytest.mark.parametrize("name", CONFIGS)
def test_replicas_bit_identical_after_sync(outcome, name):
    contract.assert_replicas_identical(*contract.suite_ranks(outcome, name))


@pytest.mark.parametrize("name", CONFIGS)
def test_resume_continues_bit_identically(outcome, name):
    contract.assert_resume_identical(contract.suite_ranks(outcome, name)[1])


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_falls(outcome, name):
    contract.assert_loss_falls(contract.suite_ranks(outcome, name)[1])


@pytest.mark.parametrize("name", CONFIGS)
def test_bytes_amortised_over_h(outcome, name):
    """Nothing on local steps; on sync steps fp32: all-reduce of n + 3 floats; bf16:
    all-gather of an 8-byte header plus n bf16 values."""
    world, per_rank = contract.suite_ranks(outcome, name)
    k = CONFIGS[name]["kwargs"]["sync_every"]
    if CONFIGS[name]["kwargs"].get("wire", "fp32") == "fp32":
        n = 4 * (NUMEL + 3)
        link = 2 * n * (world - 1) // world
    else:
        n = 8 + 2 * NUMEL
        link = n * (world - 1)
    sync = {"payload_bytes": n, "link_bytes_sent": link, "link_bytes_received": link, "collectives": 1}
    for result in per_rank:
        for step, counters in enumerate(result["counters"][1:], start=2):      # step 1 also handshakes
            assert counters == (sync if step % k == 0 else dict.fromkeys(sync, 0)), step
        assert result["by_tag"]["payload"] == {key: v * (contract.STEPS // k) for key, v in sync.items()}


def simulate(world: int) -> torch.Tensor:
    """W replicas with their own torch AdamW; every H steps the outer Nesterov step on the
    mean pseudo-gradient, from the equations: b = μb + Δ; θ₀ -= lr (Δ + μb)."""
    models = [problem.make_model() for _ in range(world)]
    inners = [torch.optim.AdamW(list(m.parameters()), lr=0.01) for m in models]
    anchor = problem.flat_params(models[0]).clone()
    buf = torch.zeros_like(anchor)
    for t in range(1, SIM_STEPS + 1):
        for m, (model, inner) in enumerate(zip(models, inners)):
            x, y = problem.batch(m, t - 1)
            problem.loss_on(model, x, y).backward()
            inner.step()
            inner.zero_grad()
        if t % H == 0:
            delta = torch.stack([anchor - problem.flat_params(m) for m in models]).mean(0)
            buf = OUTER_MOMENTUM * buf + delta
            anchor = anchor - OUTER_LR * (delta + OUTER_MOMENTUM * buf)
            for model in models:
                torch.nn.utils.vector_to_parameters(anchor.clone(), model.parameters())   # a copy each
    return anchor


def test_matches_independent_simulation(outcome):
    world, results = outcome
    expected = simulate(world)
    for result in results:
        torch.testing.assert_close(result["sim"], expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(result["sim"], results[0]["sim"])


def test_bad_peers_fail_on_every_rank(outcome):
    world, results = outcome
    if world == 1:
        pytest.skip("needs peers")
    assert all(r["bad"][0][0] == "PeerMismatchError" for r in results), [r["bad"] for r in results]
    assert all(r["bad"][1] == ["ok", "NonFiniteGradientError"] for r in results), [r["bad"] for r in results]


@pytest.mark.parametrize("kwargs, name", [
    ({"sync_every": 0}, "sync_every"), ({"sync_every": 1.5}, "sync_every"), ({"outer_lr": -1.0}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"), ({"wire": "sign"}, "wire"), ({"inner": lambda ps: 3}, "inner"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DiLoCo([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_default_inner_is_adamw_and_lr_schedulers_reach_it():
    p = torch.nn.Parameter(torch.randn(3))
    opt = DiLoCo([p])
    assert isinstance(opt.inner, torch.optim.AdamW) and opt.sync_every == 32
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    p.grad = torch.ones_like(p)
    opt.step()
    scheduler.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.5e-3)
