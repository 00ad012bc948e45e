"""overlap=True is the same algorithm with each exchange applied one call later, checked on
2 gloo ranks against that reference built by hand from the optimizer without overlap.

With overlap, call t finishes step t − 1's exchange and then starts step t, so the state
advances exactly as without overlap (start t − 1, finish t − 1, start t, ...); what differs
is where the caller's gradient is taken: at the parameters as start_step() of the previous
call left them, before its exchange was applied. The reference runs the optimizer without
overlap through start_step()/finish_step(), takes each gradient at a copy of the parameters
made between the two calls of the previous step, and must agree bit for bit. For optimizers
exchanging every step that is the gradient at the parameters of two calls before; for
LoRDO and DiLoCo, whose local steps are not delayed, only the gradient after a sync is taken
at the pre-sync parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist import run_workers
from tests.optim import problem
from tests.optim.registry import REGISTRY

STEPS = 10
PAIRS = {name: name.removesuffix("-overlap") for name in REGISTRY if name.endswith("-overlap")}


def _overlapped(name: str, rank: int) -> torch.Tensor:
    model = problem.make_model()
    opt = REGISTRY[name].build(list(model.parameters()))
    for step in range(STEPS):
        problem.loss_on(model, *problem.batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    return problem.flat_params(model)


def _late_gradient_reference(name: str, rank: int) -> torch.Tensor:
    model = problem.make_model()
    opt = REGISTRY[PAIRS[name]].build(list(model.parameters()))
    seen = copy.deepcopy(model)                  # the parameters the overlapped caller sees
    for step in range(STEPS):
        seen.zero_grad()
        problem.loss_on(seen, *problem.batch(rank, step)).backward()
        for p, q in zip(model.parameters(), seen.parameters()):
            p.grad = q.grad.clone()
        opt.start_step()
        seen = copy.deepcopy(model)              # this step started, its exchange not yet applied
        opt.finish_step()
        opt.zero_grad()
    return problem.flat_params(model)


def _both(rank: int, world: int) -> dict:
    return {name: (_overlapped(name, rank), _late_gradient_reference(name, rank)) for name in PAIRS}


@pytest.fixture(scope="module")
def runs():
    return run_workers(_both, 2, timeout=600)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_overlap_is_the_algorithm_with_each_exchange_applied_a_call_later(runs, name):
    for per_rank in runs:
        overlapped, reference = per_rank[name]
        assert torch.equal(overlapped, reference)
        assert not torch.equal(overlapped, problem.flat_params(problem.make_model()))   # it trained


def test_overlap_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap"):
        REGISTRY["demo"].build([torch.nn.Parameter(torch.zeros(3))], overlap=1)
