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
    out["bf16 params"] = _bf16_params_step(rank, [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16])
    out["bf16 params"] += _bf16_params_step(rank, [torch.bfloat16] * 4)      # one dtype: one cat, one widening copy
    return out


def _rank_grad(rank: int, shape, dtype) -> torch.Tensor:
    """Rank r's gradient: 1 + (r + 1)/128 + the position/1024, exact in bf16; their float32
    mean falls between bf16 values, so its rounding shows."""
    at = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    return (1 + (rank + 1) / 128 + at / 1024).to(dtype)


def _bf16_params_step(rank: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Parameters of several shapes in `dtypes`, float32 on the wire: each gradient the
    float32 mean rounded once to its dtype (θ = 0 − 1 · mean)."""
    shapes = [(3, 4), (7,), (2, 5), (6,)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    opt = thinwire.DenseAllReduce(torch.optim.SGD(params, lr=1.0))
    for _ in range(2):                                     # the second step reuses the rounding buffer
        for p in params:
            p.grad = _rank_grad(rank, p.shape, p.dtype)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("world", [2, 4])
def test_step_uses_mean_gradient(world):
    results = run_workers(_one_sgd_step, world)
    mean = sum(range(1, world + 1)) / world
    for by_dtype in results:
        for p in by_dtype.pop("bf16 params"):
            rounded = (sum(_rank_grad(r, p.shape, p.dtype).float() for r in range(world)) / world).to(p.dtype)
            assert p.dtype in (torch.bfloat16, torch.float32)
            assert torch.equal(p, -2 * rounded)
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
