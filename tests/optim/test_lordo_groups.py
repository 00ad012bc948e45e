"""LoRDO's stacked path (`thinwire.optim.lordo_groups`) on stacks of several same-shape
parameters, at one rank in-process: against an independent per-matrix simulation of the
equations (lordo.py's module docstring; the batched norms, GEMMs and SVDs sum in another order,
so to float tolerance), against the per-tensor path (`grouped = False`), through a checkpoint,
and with bf16 parameters. Stacks of both projection sides, conv weights, vectors, a
low_rank=False group, a group without error feedback or clip, and a parameter that misses a
gradient (its stack goes one tensor at a time from then on: its step count differs)."""

from __future__ import annotations

import io

import pytest
import torch

from thinwire.optim.lordo import LoRDO

K, STEPS = 3, 10
BASE = {"lr": 0.01, "rank": 3, "omega": 0.8, "clip": 1.0, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}
GROUPS = [   # (shapes, overrides of BASE)
    ([(12, 5)] * 3 + [(4, 10)] * 3 + [(6, 2, 2, 2)] * 2 + [(7,)] * 3, {}),
    ([(5, 5)] * 2, {"low_rank": False, "weight_decay": 0.0}),
    ([(8, 6)] * 2 + [(6, 8)], {"error_feedback": False, "clip": None, "omega": 0.5}),
]
MISSING = (4, 1)                               # (step, parameter index): no gradient then


def _params(dtype=torch.float32) -> list[list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [[torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes] for shapes, _ in GROUPS]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Scales from 0.05 to 2: some gradients clipped (‖G‖ > 1), others not."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=gen) * (0.05 + 0.3 * (i % 7)) for i, p in enumerate(params)]
    if step == MISSING[0]:
        grads[MISSING[1]] = None
    return grads


def _build(groups, **options) -> LoRDO:
    return LoRDO([{"params": ps, **extra} for ps, (_, extra) in zip(groups, GROUPS)], sync_every=K, **BASE, **options)


def _run(opt: LoRDO, flat: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for p, g in zip(flat, _grads(step, flat)):
            p.grad = None if g is None else g.to(p.dtype)
        opt.step()


def _simulate() -> list[torch.Tensor]:
    """The equations, one parameter at a time, in float32, at one rank (Δ̄ = Δ)."""
    groups = _params()
    hyper = [{**BASE, "low_rank": None, "error_feedback": True, **extra} for _, extra in GROUPS]
    flat = [(p.detach().clone(), h) for ps, h in zip(groups, hyper) for p in ps]
    anchors, states = [p.clone() for p, _ in flat], [{"t": 0} for _ in flat]
    for step in range(STEPS):
        for (p, h), s, g in zip(flat, states, _grads(step, [p for p, _ in flat])):
            if g is not None:
                _local(p, h, s, g)
        if (step + 1) % K == 0:
            for i, (p, h) in enumerate(flat):
                delta = p - anchors[i]
                anchors[i] = anchors[i] + delta
                p.copy_(anchors[i])
                if "Q" in states[i]:
                    _refresh(states[i], delta.reshape(p.shape[0], -1), h["rank"])
    return [p for p, _ in flat]


def _local(p: torch.Tensor, h: dict, s: dict, g: torch.Tensor) -> None:
    lr, (b1, b2), eps, om = h["lr"], h["betas"], h["eps"], h["omega"]
    s["t"] += 1
    t = s["t"]
    if h["clip"] is not None:
        g = g * min(1.0, h["clip"] / float(g.norm()))
    p.mul_(1 - lr * h["weight_decay"])
    if p.dim() < 2 or h["low_rank"] is False:
        s.setdefault("u", torch.zeros_like(p)), s.setdefault("v", torch.zeros_like(p))
        s["u"], s["v"] = b1 * s["u"] + (1 - b1) * g, b2 * s["v"] + (1 - b2) * g * g
        p.sub_(lr * (s["u"] / (1 - b1 ** t)) / ((s["v"] / (1 - b2 ** t)).sqrt() + eps))
        return
    m = g.reshape(p.shape[0], -1)
    flip = _flip(m)                            # the left side (p < q) is the right side of Gᵀ
    x, r = flip(m), min(h["rank"], *m.shape)
    s.setdefault("Q", torch.eye(x.shape[1])[:, :r])
    a = x + s["E"] if "E" in s else x
    low = a @ s["Q"]
    if h["error_feedback"]:
        s["E"] = a - low @ s["Q"].T
    s.setdefault("u", torch.zeros_like(low)), s.setdefault("v", torch.zeros_like(low))
    s["u"], s["v"] = b1 * s["u"] + (1 - b1) * low, b2 * s["v"] + (1 - b2) * low * low
    d = (s["v"] / (1 - b2 ** t)).sqrt() + eps
    step = om * (s["u"] / (1 - b1 ** t) / d) @ s["Q"].T + (1 - om) * x / d.mean()
    p.sub_(lr * flip(step).reshape(p.shape))


def _flip(m: torch.Tensor):
    """x -> x on the right side (p ≥ q), x -> xᵀ on the left: state kept for the transpose."""
    return (lambda x: x) if m.shape[0] >= m.shape[1] else (lambda x: x.T)


def _refresh(s: dict, delta: torch.Tensor, rank: int) -> None:
    """Q_new from the SVD of Δ (of Δᵀ on the left side: its right vectors are Δ's left ones)."""
    x = _flip(delta)(delta)
    q_new = torch.linalg.svd(x, full_matrices=False)[2][:min(rank, *x.shape)].T
    c = s["Q"].T @ q_new
    s["u"], s["v"], s["Q"] = s["u"] @ c, s["v"] @ (c * c), q_new


def _trained(grouped: bool = True, dtype=torch.float32, steps: int = STEPS,
             **options) -> tuple[LoRDO, list[torch.nn.Parameter]]:
    groups = _params(dtype)
    opt = _build(groups, **options)
    opt.grouped = grouped
    flat = [p for ps in groups for p in ps]
    _run(opt, flat, range(steps))
    return opt, flat


def test_stacks_match_an_independent_simulation():
    opt, flat = _trained()
    for ours, theirs in zip(flat, _simulate()):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-4, atol=1e-6)
    stacked = opt.state[flat[0]]["exp_avg"]            # (12, 5) x 3: one buffer, three views
    assert all(opt.state[p]["exp_avg"].untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
               for p in flat[:3])
    assert opt.state[flat[1]]["step"] == STEPS - 1 and opt.state[flat[0]]["step"] == STEPS


def test_stacks_match_the_per_tensor_path():
    _, stacked = _trained(grouped=True)
    _, each = _trained(grouped=False)
    for a, b in zip(stacked, each):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)


def test_bf16_stacks_keep_float32_state_and_follow_the_per_tensor_path():
    opt, stacked = _trained(dtype=torch.bfloat16)
    _, each = _trained(grouped=False, dtype=torch.bfloat16)
    for a, b in zip(stacked, each):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=2e-2, atol=2e-2)
    assert all(t.dtype == torch.float32 for p in stacked for k, t in opt.state[p].items()
               if torch.is_tensor(t) and k != "anchor")


def test_a_checkpoint_mid_interval_resumes_bit_identically():
    """state_dict holds each parameter's views; a fresh optimizer copies the loaded tensors
    into its own stacks and continues bit for bit (the syncs at steps 6 and 9 included)."""
    groups = _params()
    flat = [p for ps in groups for p in ps]
    opt = _build(groups)
    _run(opt, flat, range(5))
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    twins = [[torch.nn.Parameter(p.detach().clone()) for p in ps] for ps in groups]
    fresh = _build(twins)
    fresh.load_state_dict(torch.load(blob, weights_only=False))
    flat_twins = [p for ps in twins for p in ps]
    _run(opt, flat, range(5, STEPS))
    _run(fresh, flat_twins, range(5, STEPS))
    for p, twin in zip(flat, flat_twins):
        assert torch.equal(p, twin)
        for key, value in opt.state[p].items():
            assert torch.equal(torch.as_tensor(fresh.state[twin][key]), torch.as_tensor(value)), key


def _states(opt: LoRDO, flat: list[torch.nn.Parameter]) -> list:
    """Every parameter and state value (the step counts settled: `state_dict` reads the flags)."""
    opt.state_dict()
    return [(p.detach().clone(), {k: torch.as_tensor(v).clone() for k, v in opt.state[p].items()}) for p in flat]


def _assert_same(a: list, b: list) -> None:
    for (p, state), (q, other) in zip(a, b):
        assert torch.equal(p, q) and state.keys() == other.keys()
        assert all(torch.equal(state[k], other[k]) for k in state), [k for k in state if not torch.equal(state[k], other[k])]


@pytest.mark.parametrize("every", [True, False], ids=["all-nan", "every-other"])
@pytest.mark.parametrize("grouped", [True, False], ids=["stacked", "per-tensor"])
def test_skip_a_nonfinite_local_step_is_a_step_without_gradients(grouped, every):
    """nonfinite='skip' at one rank: a NaN gradient's local step runs under the device's flag and
    moves nothing; its step counts are taken back at the next call, so the run goes on bit for
    bit as one whose step had no gradient at all (the syncs at steps 3, 6 and 9 included).
    every-other: the others have none, so their stacks go one tensor at a time that step."""
    runs = []
    for nan in (True, False):
        opt, flat = _trained(grouped, steps=4, nonfinite="skip")
        for i, p in enumerate(flat):
            p.grad = torch.full(p.shape, float("nan")) if nan and (every or i % 2) else None
        opt.step()                                                  # step 5: a local step
        _run(opt, flat, range(5, STEPS))
        runs.append(_states(opt, flat))
        assert opt.skipped_steps == []                              # one rank's local skip: no step of all
    _assert_same(*runs)


@pytest.mark.parametrize("grouped", [True, False], ids=["stacked", "per-tensor"])
def test_skip_a_nonfinite_sync_moves_nothing(grouped):
    """A NaN at a sync (fp32: landed under the device's verdict): parameters, anchors, bases,
    moments and counts all as before that step; the skip is reported at the next call."""
    opt, flat = _trained(grouped, steps=5, nonfinite="skip")
    before = _states(opt, flat)
    for p in flat:
        p.grad = torch.ones_like(p)
    flat[0].grad[0, 0] = float("inf")
    opt.step()                                                      # step 6: a sync
    assert opt.skipped_steps == [6]
    _assert_same(_states(opt, flat), before)
