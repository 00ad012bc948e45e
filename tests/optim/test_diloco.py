"""DiLoCo on real gloo groups (world sizes 1 and 2): against an independent simulation of W
workers (torch AdamW inner, Nesterov outer written from the equations), the nonfinite policy
at and between syncs (anchor untouched), bad arguments, defaults.

The shared suite (test_suite.py) checks 'diloco' (AdamW inner, fp32 wire) for everything
every optimizer owes, bad peers and a NaN carried from a local step to the sync included;
and, at world sizes 1 and 2, what 'diloco' leaves at its defaults (registry.py's VARIANTS:
an SGD inner optimizer, bf16 and int8 wires) for replicas and resume after 50 steps (a sync
every 10) and every step's bytes.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.dist import outcome_of
from tests.optim import problem
from tests.optim.suite import on_world
from thinwire.optim.diloco import DiLoCo


def make_diloco(params, inner_lr=0.03, **kwargs):
    return DiLoCo(params, inner=lambda ps: torch.optim.AdamW(ps, lr=inner_lr), **kwargs)


H, OUTER_LR, OUTER_MOMENTUM, SIM_STEPS = 4, 0.7, 0.9, 12
WORLDS = [1, 2]


NAN_CASES = {   # name: (wire, nonfinite, step whose gradient is NaN on the last rank; H = 2: step 1 syncs)
    "fp32-sync": ("fp32", "raise", 1), "fp32-carried": ("fp32", "raise", 0), "bf16-skip-sync": ("bf16", "skip", 1),
}


def _nan_on_last_rank(rank, world, wire, nonfinite, nan_step):
    q = torch.nn.Parameter(torch.ones(6))
    initial = q.detach().clone()
    opt = DiLoCo([q], sync_every=2, wire=wire, nonfinite=nonfinite)
    statuses, anchor_after_first_sync = [], None
    for step in range(4):
        q.grad = torch.full_like(q, 1.0 + rank + step)
        if step == nan_step and rank == world - 1:
            q.grad[2] = float("nan")
        statuses.append(outcome_of(opt.step)[0])
        if step == 1:
            anchor_after_first_sync = opt.state[q]["anchor"].clone()
    return {"statuses": statuses, "initial": initial, "anchor": anchor_after_first_sync, "final": q.detach().clone()}


def _simulated_run(rank):
    model = problem.make_model()
    opt = make_diloco(list(model.parameters()), inner_lr=0.01, sync_every=H)
    for step in range(SIM_STEPS):
        problem.loss_on(model, *problem.batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    return problem.flat_params(model)


def suite(rank, world):
    return {"sim": _simulated_run(rank),
            "nan": {name: _nan_on_last_rank(rank, world, *case) for name, case in NAN_CASES.items()}}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def outcome(request):
    return request.param, on_world(suite, request.param, timeout=300)


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


@pytest.mark.parametrize("case", ["fp32-sync", "fp32-carried"])
def test_nonfinite_raises_on_every_rank_at_the_sync(outcome, case):
    """A NaN at the sync step, or at a local step ('raise' carries it to the next sync):
    every rank raises at the sync, no anchor moves, and the next sync goes through."""
    _, results = outcome
    for r in results:
        assert r["nan"][case]["statuses"] == ["ok", "NonFiniteGradientError", "ok", "ok"], r["nan"][case]
        assert torch.equal(r["nan"][case]["anchor"], r["nan"][case]["initial"])
        assert torch.equal(r["nan"][case]["final"], results[0]["nan"][case]["final"])


def test_nonfinite_skip_skips_the_sync_and_the_next_one_joins_the_replicas(outcome):
    _, results = outcome
    for r in results:
        case = r["nan"]["bf16-skip-sync"]
        assert case["statuses"] == ["ok"] * 4
        assert torch.equal(case["anchor"], case["initial"])
        assert torch.equal(case["final"], results[0]["nan"]["bf16-skip-sync"]["final"])
        assert not torch.equal(case["final"], case["initial"])


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


def test_non_contiguous_parameters_step_like_contiguous_ones():
    """A channels_last conv weight and a transposed matrix: same steps as contiguous twins."""
    torch.manual_seed(5)
    conv, wide = torch.randn(6, 3, 3, 3).to(memory_format=torch.channels_last), torch.randn(9, 5).t()
    strided = [torch.nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in (conv, wide)]
    plain = [torch.nn.Parameter(t.contiguous()) for t in (conv, wide)]
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous()
    for params in (strided, plain):
        opt = DiLoCo(params, inner=lambda ps: torch.optim.AdamW(ps, lr=0.01), sync_every=3, wire="int8")
        gen = torch.Generator().manual_seed(0)
        for _ in range(7):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    for s, p in zip(strided, plain):
        torch.testing.assert_close(s.detach(), p.detach(), rtol=1e-6, atol=1e-7)
    assert strided[0].is_contiguous(memory_format=torch.channels_last)


def test_state_dict_carries_the_envelope_and_flushes():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = DiLoCo([p], sync_every=2)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    fresh = DiLoCo([torch.nn.Parameter(p.detach().clone())], sync_every=2)
    fresh.load_state_dict(torch.load(blob, weights_only=False))
    assert fresh.steps_done == 3 and fresh.comm_stats.as_dict() == opt.comm_stats.as_dict()
    with pytest.raises(ValueError, match="nonfinite"):
        DiLoCo([p], nonfinite="ignore")


def _bf16_reference(params: list[torch.Tensor], grads: list[list[torch.Tensor]], sync_every: int) -> list[torch.Tensor]:
    """DiLoCo at world 1 written per tensor from the equations, rounding where a bf16 run must:
    Δ = θ − θ₀ in float32 (exact); b ← μb − Δ; h = Δ − μb; θ₀ ← θ₀ + η_out·round(h); θ ← θ₀."""
    params = [p.detach().clone() for p in params]
    anchors = [p.clone() for p in params]
    bufs = [torch.zeros(p.shape) for p in params]
    for step, gs in enumerate(grads, start=1):
        for p, g in zip(params, gs):
            p.sub_(g, alpha=0.1)                                   # the inner SGD step
        if step % sync_every:
            continue
        for p, a, b in zip(params, anchors, bufs):
            delta = p.float() - a.float()
            b.mul_(OUTER_MOMENTUM).sub_(delta)
            h = delta.sub(b, alpha=OUTER_MOMENTUM)
            a.add_(h.to(a.dtype), alpha=OUTER_LR)
            p.copy_(a)
    return params


def test_bf16_parameters_take_the_flat_sync_with_per_tensor_rounding():
    """bf16 parameters beside a float32 one: Δ, the outer step and θ ← θ₀ through flat
    buffers (`DenseMean._write_deltas`, `nesterov_outer_all_`'s flats) land bit for
    bit where the per-tensor equations do."""
    gen = torch.Generator().manual_seed(0)
    shapes, dtypes = [(5, 3), (4,), (7,)], [torch.bfloat16, torch.float32, torch.bfloat16]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(shapes, dtypes)]
    grads = [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(6)]
    expected = _bf16_reference(params, grads, sync_every=2)
    opt = DiLoCo(params, inner=lambda ps: torch.optim.SGD(ps, lr=0.1), sync_every=2, outer_lr=OUTER_LR,
                 outer_momentum=OUTER_MOMENTUM)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    assert opt.sync._low is not None and opt.sync._low.dtype == torch.bfloat16      # the flat path ran
    for p, q in zip(params, expected):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q)
