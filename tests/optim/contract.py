"""A per-file contract run, for optimizer options the shared registry (registry.py, checked
by suite.py / test_suite.py) does not cover; run inside real gloo workers.

`run_contract(rank, world, configs)` trains each config on the shared problem and returns,
per config: final parameters (for cross-rank bit comparison), the parameters of a run that
was checkpointed mid-way and resumed into fresh objects, per-step byte counters, and the
loss before and after. test_apmsqueeze.py, test_ef21_muon.py, test_lordo.py and
test_diloco.py assert on them with the helpers below.
"""

from __future__ import annotations

import io
import traceback

import pytest
import torch

from tests.dist import run_workers
from tests.optim import problem

STEPS, RESUME_AT = 50, 25


def build(config: dict, model: torch.nn.Module):
    """The optimizer a config names: config["factory"](params, **config["kwargs"]), a
    module-level function (workers are spawned: it must pickle)."""
    return config["factory"](list(model.parameters()), **config.get("kwargs", {}))


def train(config: dict, rank: int, start: int, stop: int, model=None, opt=None):
    model = model if model is not None else problem.make_model()
    opt = opt if opt is not None else build(config, model)
    counters = []
    for step in range(start, stop):
        x, y = problem.batch(rank, step)
        problem.loss_on(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        counters.append(opt.comm_stats.last_step.as_dict())
    return model, opt, counters


def _resumed(config: dict, rank: int) -> torch.Tensor:
    model, opt, _ = train(config, rank, 0, RESUME_AT)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    fresh_model = problem.make_model(seed=77)  # different init: the checkpoint must restore it
    fresh_model.load_state_dict(saved["model"])
    fresh_opt = build(config, fresh_model)
    fresh_opt.load_state_dict(saved["opt"])
    fresh_model, fresh_opt, _ = train(config, rank, RESUME_AT, STEPS, fresh_model, fresh_opt)
    return problem.flat_params(fresh_model), fresh_opt.comm_stats.by_tag["payload"].as_dict()


def run_one(config: dict, rank: int) -> dict:
    initial = problem.eval_loss(problem.make_model())
    model, opt, counters = train(config, rank, 0, STEPS)
    resumed, resumed_totals = _resumed(config, rank)
    return {"params": problem.flat_params(model), "resumed": resumed, "counters": counters,
            "totals": opt.comm_stats.as_dict(), "by_tag": {k: v.as_dict() for k, v in opt.comm_stats.by_tag.items()},
            "resumed_payload_totals": resumed_totals, "loss_before": initial, "loss_after": problem.eval_loss(model)}


def run_contract(rank: int, world: int, configs: dict) -> dict:
    results = {}
    for name, config in configs.items():
        try:
            results[name] = run_one(config, rank)
        except Exception:  # one failing config must not hide the others' results
            results[name] = {"error": traceback.format_exc()}
    return results


def per_rank(outcome, name: str) -> tuple[int, list]:
    """(world, [result per rank]) of one config from run_workers(run_contract, ...); fails on errors."""
    world, results = outcome
    ranks = [r[name] for r in results]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    return world, ranks


def suite_ranks(outcome, name: str) -> tuple[int, list]:
    """per_rank for a suite whose per-rank results hold run_contract's under 'contract'."""
    world, results = outcome
    return per_rank((world, [r["contract"] for r in results]), name)


def suite_fixture(suite, configs: dict, worlds, timeout: float = 300):
    """A module-scoped fixture `outcome` = (world, [suite(rank, world, configs) per rank]) for
    each world; a world of one runs in this process (no process group, no spawn)."""
    @pytest.fixture(scope="module", params=worlds, ids=lambda w: f"world{w}")
    def outcome(request):
        world = request.param
        if world == 1:
            return world, [suite(0, 1, configs)]
        return world, run_workers(suite, world, args=(configs,), timeout=timeout)
    return outcome


def assert_replicas_identical(world: int, ranks: list, key: str = "params") -> None:
    for r in range(1, world):
        assert torch.equal(ranks[r][key], ranks[0][key]), f"rank {r} drifted from rank 0"


def assert_resume_identical(ranks: list) -> None:
    for result in ranks:
        assert torch.equal(result["resumed"], result["params"])
        # Payload counters carry over through the checkpoint; the resumed process handshakes anew.
        assert result["resumed_payload_totals"] == result["by_tag"]["payload"]


def assert_loss_falls(ranks: list, factor: float = 0.5) -> None:
    result = ranks[0]
    assert result["loss_after"] < factor * result["loss_before"], (result["loss_before"], result["loss_after"])
