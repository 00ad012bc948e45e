"""DenseAllReduce: the gradient it hands the wrapped optimizer is the ranks' mean."""

import pytest
import torch

import thinwire
from tests.dist import run_workers


def _one_sgd_step(rank, world):
    """One SGD step per gradient dtype, both in one spawn (a spawn costs seconds of start-up)."""
    out = {}
    for grad_dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.zeros(5))
        opt = thinwire.DenseAllReduce(torch.optim.SGD([p], lr=1.0), grad_dtype=grad_dtype)
        p.grad = torch.full((5,), float(rank + 1))
        opt.step()
        out[grad_dtype] = p.detach().clone(), opt.comm_stats.by_tag["payload"].as_dict()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_step_uses_mean_gradient(world):
    results = run_workers(_one_sgd_step, world)
    mean = sum(range(1, world + 1)) / world
    for by_dtype in results:
        for grad_dtype, (params, counters) in by_dtype.items():
            assert torch.equal(params, torch.full((5,), -mean))
            # 5 values and the trailer: 1 flag, 16 lockstep slots, 1 presence count (optim/protocol.py)
            assert counters["payload_bytes"] == (5 + 1 + 16 + 1) * (4 if grad_dtype == torch.float32 else 2)


def test_lr_scheduler_on_wrapper_reaches_wrapped_optimizer_after_load():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = thinwire.DenseAllReduce(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.ones(3)
    opt.step()
    fresh = thinwire.DenseAllReduce(torch.optim.SGD([p], lr=1.0))
    fresh.load_state_dict(opt.state_dict())
    torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 0.25)
    assert fresh.optimizers[0].param_groups[0]["lr"] == 0.25


def test_bad_arguments():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="optimizers"):
        thinwire.DenseAllReduce([])
    with pytest.raises(ValueError, match="grad_dtype"):
        thinwire.DenseAllReduce(torch.optim.SGD([p], lr=1.0), grad_dtype=torch.float16)
    with pytest.raises(ValueError, match="nonfinite"):
        thinwire.DenseAllReduce(torch.optim.SGD([p], lr=1.0), nonfinite="warn")
