"""Bad peers on real gloo groups: every rank gets the same explicit error, nobody hangs."""

import pytest
import torch

import thinwire
from tests.dist import outcome_of, run_workers




def _mismatched_shapes(rank, world):
    p = torch.nn.Parameter(torch.randn(16, 16 if rank == 0 else 17))
    opt = thinwire.DeMo([p])
    p.grad = torch.randn_like(p)
    return outcome_of(opt.step)


def _nan_on_last_rank(rank, world, nonfinite, kind):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(32, 32))
    opt = (thinwire.DeMo([p], nonfinite=nonfinite) if kind == "demo"
           else thinwire.DenseAllReduce(torch.optim.SGD([p], lr=0.1), nonfinite=nonfinite))
    before = p.detach().clone()
    p.grad = torch.randn_like(p)
    if rank == world - 1:
        p.grad[3, 5] = float("nan")
    status = outcome_of(opt.step)
    unchanged = torch.equal(p.detach(), before)
    # A finite step afterwards proves no rank is stuck in a collective.
    p.grad = torch.ones_like(p)
    after_status = outcome_of(opt.step)
    return status, unchanged, after_status[0], p.detach().clone()


def _out_of_lockstep(rank, world):
    p = torch.nn.Parameter(torch.ones(8, 8))
    opt = thinwire.DeMo([p])
    p.grad = torch.ones_like(p)
    opt.step()
    if rank == 1:
        opt.state[p]["step"] += 3        # as if resumed from another checkpoint
    return outcome_of(opt.step)


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_shapes_fail_on_every_rank(world):
    results = run_workers(_mismatched_shapes, world)
    assert all(kind == "PeerMismatchError" for kind, _ in results), results
    assert "differ across ranks" in results[0][1]


@pytest.mark.parametrize("kind", ["demo", "dense"])
def test_nonfinite_gradient_raises_on_every_rank(kind):
    results = run_workers(_nan_on_last_rank, 3, args=("raise", kind))
    for (status, message), unchanged, after, _ in results:
        assert status == "NonFiniteGradientError" and unchanged and after == "ok"
    if kind == "demo":
        assert "rank(s) [2]" in results[0][0][1]


@pytest.mark.parametrize("kind", ["demo", "dense"])
def test_nonfinite_gradient_skip_moves_nobody_and_replicas_stay_identical(kind):
    results = run_workers(_nan_on_last_rank, 3, args=("skip", kind))
    for (status, _), unchanged, after, _ in results:
        assert status == "ok" and unchanged and after == "ok"
    assert all(torch.equal(r[3], results[0][3]) for r in results)


def test_ranks_out_of_lockstep_fail_on_every_rank():
    results = run_workers(_out_of_lockstep, 2)
    assert all(kind == "PeerMismatchError" and "lockstep" in msg for kind, msg in results), results
