"""APMSqueeze's grouped path (`thinwire.optim.apmsqueeze_steps`, flat m and v) against its
per-tensor path (`grouped = False`), bit for bit, step after step, on real gloo groups of 2 and
3: through the warmup and the switch to 1-bit, two param groups (other lr, weight decay and
betas: several runs of the flat buffers), a parameter with a gradient on no rank and one with a
gradient on one rank only, a NaN gradient on one rank in each phase with nonfinite='skip'
(the grouped path lands it under the device's verdict, the per-tensor path reads it first),
bf16 parameters (float32 state), overlap, and scale='tensor'. Parameters, every state entry, both error
buffers, the step counts and the skipped steps must be equal after every step."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim.suite import on_world
from thinwire.optim.apmsqueeze import APMSqueeze

SHAPES = [(6, 5), (7,), (3, 4), (9,), (2, 3, 4)]
STEPS, WARMUP = 11, 5
ABSENT = {7: (1, None), 9: (3, 0)}     # step -> (parameter, the rank that has a gradient; None: no rank)
NAN = {4: 2, 8: 0}                     # step -> parameter made NaN on the last rank


def _build(params, grouped: bool, overlap: bool, scale: str) -> APMSqueeze:
    groups = [{"params": params[:3], "weight_decay": 0.1},
              {"params": params[3:], "lr": 5e-3, "betas": (0.8, 0.95), "weight_decay": 0.0}]
    opt = APMSqueeze(groups, lr=1e-2, warmup_steps=WARMUP, nonfinite="skip", overlap=overlap, scale=scale)
    opt.grouped = grouped
    return opt


def _snapshot(opt: APMSqueeze, params) -> list:
    skipped = opt.skipped_steps                         # judged first: a skipped step's counts taken back
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in params]
    errors = [e.clone() for e in (opt.worker_error, opt.server_error) if e is not None]
    return [[p.detach().clone() for p in params], state, errors, skipped]


def _run(rank: int, world: int, dtype_name: str, overlap: bool, scale: str) -> list:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    runs = []
    for grouped in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = _build(params, grouped, overlap, scale)
        gen = torch.Generator().manual_seed(10 + rank)
        history = []
        for step in range(1, STEPS + 1):
            for k, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                if step in ABSENT and ABSENT[step][0] == k and ABSENT[step][1] != rank:
                    p.grad = None
            if step in NAN and rank == world - 1:
                params[NAN[step]].grad.view(-1)[1] = float("nan")
            opt.step()
            history.append(_snapshot(opt, params))
        opt.flush()
        history.append(_snapshot(opt, params))
        runs.append(history)
    return runs


def _equal(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("world, dtype_name, overlap, scale", [
    (2, "fp32", False, "chunk"), (3, "fp32", False, "chunk"), (2, "bf16", False, "chunk"), (2, "fp32", True, "chunk"),
    (3, "fp32", False, "tensor")])
def test_grouped_path_equals_the_per_tensor_path_bit_for_bit(world, dtype_name, overlap, scale):
    results = on_world(_run, world, dtype_name, overlap, scale, timeout=300)
    for rank, (grouped, per_tensor) in enumerate(results):
        assert len(grouped) == STEPS + 1
        for step, (g, t) in enumerate(zip(grouped, per_tensor), start=1):
            _equal(g, t, f"rank {rank} step {step}")
    final = results[0][0][-1]
    assert final[3] == [4, 8]
    assert final[0][0].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    assert all(s["exp_avg"].dtype == torch.float32 for s in final[1])


def test_state_entries_are_views_of_one_flat_buffer_and_a_load_rebinds_them():
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = APMSqueeze(params, lr=1e-2, warmup_steps=WARMUP)
    for _ in range(WARMUP + 1):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    bases = {opt.state[p][k].untyped_storage().data_ptr() for p in params for k in ("exp_avg", "exp_avg_sq")}
    assert len(bases) == 2                                        # m and v: one buffer each
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = APMSqueeze(twin, lr=1e-2, warmup_steps=WARMUP)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))         # as torch.save and torch.load would
    for p in params:
        p.grad = torch.ones_like(p)
    for p in twin:
        p.grad = torch.ones_like(p)
    opt.step()
    fresh.step()
    for a, b in zip(params, twin):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], fresh.state[b]["exp_avg"])
    assert len({fresh.state[p]["exp_avg"].untyped_storage().data_ptr() for p in twin}) == 1
    assert fresh.state[twin[0]]["exp_avg"].untyped_storage().data_ptr() != next(iter(bases))
