"""overlap=True is the same algorithm fed gradients one update late, checked on 2 gloo ranks
against that reference built by hand: the optimizer without overlap, skipping the first
call, and at call t given the gradient taken at its own parameters of two calls before.

With overlap, call t applies the message of call t − 1, whose gradient was taken (by the
backward before call t − 1) at the parameters left by call t − 2: P_t = P_{t−1} − U(ḡ(P_{t−2})),
P_1 = P_0. The optimizer's state must advance as without overlap (apply t − 1, then encode
t), so the two runs agree bit for bit.
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
    return problem.flat_params(model)


def _stale_reference(name: str, rank: int) -> torch.Tensor:
    model = problem.make_model()
    opt = REGISTRY[PAIRS[name]].build(list(model.parameters()))
    history = [copy.deepcopy(model), copy.deepcopy(model)]        # P_0 and P_1 = P_0
    for step in range(1, STEPS):                                   # call 0 applies nothing
        lagged = history[-2]                                       # P_{t−2}
        lagged.zero_grad()
        problem.loss_on(lagged, *problem.batch(rank, step - 1)).backward()
        for p, q in zip(model.parameters(), lagged.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        opt.zero_grad()
        history.append(copy.deepcopy(model))
    return problem.flat_params(model)


def _both(rank: int, world: int) -> dict:
    return {name: (_overlapped(name, rank), _stale_reference(name, rank)) for name in PAIRS}


@pytest.fixture(scope="module")
def runs():
    return run_workers(_both, 2, timeout=600)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_overlap_is_the_algorithm_on_gradients_one_update_late(runs, name):
    for per_rank in runs:
        overlapped, reference = per_rank[name]
        assert torch.equal(overlapped, reference)
        assert not torch.equal(overlapped, problem.flat_params(problem.make_model()))   # it trained


def test_overlap_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap"):
        REGISTRY["demo"].build([torch.nn.Parameter(torch.zeros(3))], overlap=1)
