"""APMSqueeze on real gloo groups, world sizes 1-4, against independent references
(tests/optim/apmsqueeze_reference.py): the two-phase compressed all-reduce against a
single-process simulation and numpy decoding of the bytes actually sent, the error-feedback
identity at both levels, warmup against torch.optim.AdamW on averaged gradients, the
compressed phase against a simulation of the paper's equations, parameters with a gradient
on no rank, the nonfinite policy in both phases (error buffers and step counters untouched),
resuming on another world size, bad arguments; in one process: non-contiguous parameters
against contiguous twins, bf16 parameters with float32 state, and the layout (frozen and
empty parameters) in the byte count.

What every optimizer owes (replicas, resume, bytes, schedulers, nonfinite, bad peers) is
checked by the shared suite (test_suite.py) for 'apmsqueeze-warmup' and
'apmsqueeze-compressed', and for the options those leave at their defaults (registry.py's
VARIANTS, world sizes 1 to 4): a resume inside warmup with the switch to 1-bit after it (and
weight decay), and bias_correction=False.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.optim import apmsqueeze_reference as ref
from tests.optim.suite import on_world
from thinwire.optim.apmsqueeze import APMSqueeze

WORLDS = [1, 2, 3, 4]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def outcome(request):
    return request.param, on_world(ref.suite, request.param, timeout=300)

# ---- the compressed all-reduce --------------------------------------------------------------

def test_allreduce_matches_single_process_simulation(outcome):
    world, results = outcome
    xs = ref.allreduce_inputs(world)
    n = xs.shape[2]
    we, se = torch.zeros(world, n), torch.zeros(world, n // world)
    for t in range(ref.ROUNDS):
        m_bar, we, se = ref.simulate_allreduce(xs[t], we, se)
        for rank, rounds in enumerate(results):
            got = rounds["allreduce"][t]
            assert torch.equal(got["m_bar"], results[0]["allreduce"][t]["m_bar"])   # every rank decodes the same
            torch.testing.assert_close(got["m_bar"], m_bar, rtol=1e-5, atol=1e-7)   # a few ulps of the ~0.01 scales
            torch.testing.assert_close(got["we_new"], we[rank], rtol=1e-5, atol=1e-7)   # a few ulps of the ~0.01 scales
            torch.testing.assert_close(got["se_new"], se[rank], rtol=1e-5, atol=1e-7)   # a few ulps of the ~0.01 scales
        # the next round's simulation continues from what the ranks really hold
        we = torch.stack([r["allreduce"][t]["we_new"] for r in results])
        se = torch.stack([r["allreduce"][t]["se_new"] for r in results])


def _one_rounding(decoded: torch.Tensor, error: torch.Tensor, target: torch.Tensor) -> None:
    """decoded + error == target, summed exactly (float64), up to the one float32 rounding of
    error = fl(target - decoded): |gap| <= 2^-24 |error| (1 + 2^-23). Exact equality cannot be
    asked of float32 error feedback; the caller asserts error == fl(target - decoded) bit for bit."""
    gap = (decoded.double() + error.double() - target.double()).abs()
    assert bool((gap <= 2.0 ** -24 * (1 + 2.0 ** -23) * error.double().abs()).all()), float(gap.max())


def test_error_feedback_identity_at_both_levels(outcome):
    """decoded message + new error == input + old error, decoding the bytes on the wire."""
    world, results = outcome
    for t in range(ref.ROUNDS):
        n = results[0]["allreduce"][t]["x"].numel()
        c = n // world
        y_hat = []
        for rank, r in enumerate(results):
            got = r["allreduce"][t]
            sent = got["log"][0][0].view(world, -1)                   # phase 1: header | scale | signs
            decoded = ref.np_decode(sent[:, ref.HEADER:], c).reshape(-1)
            y = got["x"] + got["we"]
            assert torch.equal(got["we_new"], y - decoded)            # the error is what C lost
            _one_rounding(decoded, got["we_new"], y)
            y_hat.append(decoded.view(world, c))
        if t == 0:                                                    # exact zeros (and -0.0) go as +scale
            assert bool((y_hat[0].reshape(-1)[3:5] > 0).all())
        for j, r in enumerate(results):
            got = r["allreduce"][t]
            received = got["log"][0][1]                               # [W, header + 4 + c/8], from rank i
            assert torch.equal(ref.np_decode(received[:, ref.HEADER:], c), torch.stack([y[j] for y in y_hat]))
            z = y_hat[0][j].clone()
            for y in y_hat[1:]:                                       # rank order, as documented
                z = z + y[j]
            z = z / world + got["se"]
            z_hat = ref.np_decode(got["log"][1][0].view(1, -1), c)[0]  # phase 2: scale | signs
            assert torch.equal(got["se_new"], z - z_hat)
            _one_rounding(z_hat, got["se_new"], z)
            assert torch.equal(got["m_bar"][j * c:(j + 1) * c], z_hat)


def test_allreduce_bytes_equal_packed_sizes(outcome):
    world, results = outcome
    n = ref.padded(ref.N_VALUES, world)
    c = n // world
    phase1, phase2 = world * (ref.HEADER + 4 + c // 8), 4 + c // 8
    for r in results:
        for got in r["allreduce"]:
            assert [buf.numel() for buf, _ in got["log"]] == [phase1, phase2]
            own_kept = phase1 // world                                   # its own chunk is not handed over
            assert got["after"]["payload_bytes"] - got["before"]["payload_bytes"] == phase1 - own_kept + phase2
            sent = phase1 * (world - 1) // world + phase2 * (world - 1)
            assert got["after"]["link_bytes_sent"] - got["before"]["link_bytes_sent"] == sent


# ---- the optimizer ------------------------------------------------------------------------

def test_warmup_equals_adamw_on_averaged_gradients(outcome):
    world, results = outcome
    grads = [r["grads"] for r in results]
    adam = ref.adam_reference(world, grads, ref.WARMUP)
    for r in results:
        for got, want in zip(r["optimizer"]["history"][ref.WARMUP - 1], adam.param_groups[0]["params"]):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)


def test_compressed_phase_follows_the_equations(outcome):
    """After an AdamW warmup, m_i = β1 m̄ + (1−β1) g_i, m̄ = simulated two-phase all-reduce,
    θ ← θ(1−ηλ) − η m̄/(1−β1^t) / (sqrt(v_Tw/(1−β2^Tw)) + ε)."""
    world, results = outcome
    grads = [r["grads"] for r in results]
    adam = ref.adam_reference(world, grads, ref.WARMUP)
    params = [p.detach().clone() for p in adam.param_groups[0]["params"]]
    m = [adam.state[p]["exp_avg"].clone() for p in adam.param_groups[0]["params"]]
    v = [adam.state[p]["exp_avg_sq"].clone() for p in adam.param_groups[0]["params"]]
    sizes = [p.numel() for p in params]
    n = ref.padded(sum(sizes), world)
    we, se = torch.zeros(world, n), torch.zeros(world, n // world)
    (beta1, beta2), tw = ref.BETAS, ref.WARMUP
    for t in range(ref.WARMUP + 1, ref.STEPS + 1):
        xs = torch.zeros(world, n)
        for i in range(world):
            flat_g = torch.cat([g.reshape(-1) for g in grads[i][t - 1]])
            flat_m = torch.cat([mk.reshape(-1) for mk in m])
            xs[i, :flat_g.numel()] = beta1 * flat_m + (1 - beta1) * flat_g
        m_bar, we, se = ref.simulate_allreduce(xs, we, se)
        m = list(m_bar[:sum(sizes)].split(sizes))
        m = [mk.view(p.shape) for mk, p in zip(m, params)]
        for k, p in enumerate(params):
            denom = (v[k] / (1 - beta2 ** tw)).sqrt() + ref.EPS
            params[k] = p * (1 - ref.LR * ref.WD) - ref.LR / (1 - beta1 ** t) * m[k] / denom
        for r in results:
            for got, want in zip(r["optimizer"]["history"][t - 1], params):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- parameters without gradients -------------------------------------------------------------

def test_parameter_with_gradient_on_no_rank_is_restored_exactly(outcome):
    """Flat ranges: a [0, 40), b [40, 70), c [70, 90); N = 96 for W = 1..4, server chunks of
    96 / W. In the last (compressed) step b has a gradient on no rank, c only on rank 0."""
    world, results = outcome
    chunk = 96 // world
    for rank, r in enumerate(results):
        before, after = r["absent"]["before"], r["absent"]["after"]
        assert before["worker_error"].numel() == 96 and before["server_error"].numel() == chunk
        assert torch.equal(after["params"][1], before["params"][1])               # b: not moved
        for key, value in before["state"][1].items():
            assert torch.equal(torch.as_tensor(after["state"][1][key]), torch.as_tensor(value)), key
        assert after["state"][1]["step"] == 6 and after["state"][0]["step"] == after["state"][2]["step"] == 7
        assert torch.equal(after["worker_error"][40:70], before["worker_error"][40:70])
        assert not torch.equal(after["worker_error"][:40], before["worker_error"][:40])
        lo, hi = max(40, rank * chunk), min(70, (rank + 1) * chunk)               # b's part of this server chunk
        if lo < hi:
            assert torch.equal(after["server_error"][lo - rank * chunk: hi - rank * chunk],
                               before["server_error"][lo - rank * chunk: hi - rank * chunk])
        assert not torch.equal(after["server_error"], before["server_error"])    # a and c's parts moved
        assert not torch.equal(after["params"][0], before["params"][0])
        assert not torch.equal(after["params"][2], before["params"][2])           # c: a gradient on rank 0
        for k in range(3):
            assert torch.equal(after["params"][k], results[0]["absent"]["after"]["params"][k])


# ---- nonfinite gradients, bad resumes, bad arguments ------------------------------------------

@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_gradient_on_one_rank_in_both_phases(outcome, policy):
    """raise: every rank raises NonFiniteGradientError; skip: every rank skips the step. Either
    way nothing moves and no error buffer changes; the next good step runs on every rank."""
    world, results = outcome
    if world == 1:
        pytest.skip("needs peers")
    for r in results:
        got = r["nonfinite"][policy]
        for phase in ("warmup", "compressed"):
            (status, unchanged, same_errors), (after, moved, _) = got[phase]
            if policy == "raise":
                assert status.startswith("NonFiniteGradientError"), (phase, status)
            else:
                assert status == "ok", (phase, status)
            assert unchanged and same_errors, phase
            assert after == "ok" and not moved, (phase, after)             # nobody was left inside a collective
        assert [status for status, _, _ in got["dense"]] == ["ok"] * 3 and got["primer"][0] == "ok"
        assert got["steps_done"] == 8 and got["param_steps"] == [6, 6]     # flagged steps count no parameter step
        assert torch.equal(got["params"], results[0]["nonfinite"][policy]["params"])
    if policy == "raise":
        assert f"[{world - 1}]" in results[0]["nonfinite"]["raise"]["compressed"][0][0]


def test_resume_on_another_world_size_or_rank(outcome):
    world, results = outcome
    if world == 1:
        pytest.skip("needs a multi-rank checkpoint")
    saved = results[0]["optimizer"]["state_dict"]                   # rank 0 of `world`, compressed phase
    params = [torch.nn.Parameter(t) for t in ref.initial_params()]
    with pytest.raises(ValueError, match=f"rank 0 of {world}"):
        APMSqueeze(params, lr=ref.LR, warmup_steps=ref.WARMUP).load_state_dict(saved)
    opt = APMSqueeze(params, lr=ref.LR, warmup_steps=ref.WARMUP, error_resume="reset")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved)
    assert any("restart from zero" in str(w.message) for w in caught)
    assert opt.worker_error is None and opt.steps_done == ref.STEPS
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()                                                      # world of one: continues, compressed
    assert opt.comm_stats.last_step.collectives == 2 and opt.worker_error.abs().sum() > 0


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, name in [({"warmup_steps": -1}, "warmup_steps"), ({"warmup_steps": 2.5}, "warmup_steps"),
                         ({"warmup_steps": 0}, "warmup_steps"), ({"warmup_steps": True}, "warmup_steps"),
                         ({"nonfinite": "ignore"}, "nonfinite"),
                         ({"betas": (1.0, 0.9)}, "betas"), ({"betas": (0.9, -0.1)}, "betas"),
                         ({"eps": 0.0}, "eps"), ({"eps": -1e-8}, "eps"), ({"lr": -1.0}, "lr"),
                         ({"weight_decay": -0.1}, "weight_decay"), ({"error_resume": "keep"}, "error_resume"),
                         ({"warmup_steps": 1}, "warmup_steps must be >= 5"),
                         ({"warmup_steps": 4}, "warmup_steps must be >= 5")]:
        args = {"lr": 0.1, "warmup_steps": 5, **kwargs}
        with pytest.raises(ValueError, match=name):
            APMSqueeze(p, **args)
    with pytest.raises(ValueError, match="v stays 0"):                # the reason, not only the name
        APMSqueeze(p, lr=0.1, warmup_steps=0)
    with pytest.raises(ValueError, match="divided by it diverges"):   # too few: v̂ too noisy to divide by
        APMSqueeze(p, lr=0.1, warmup_steps=3)
    with pytest.raises(TypeError):                                    # the undocumented option is gone
        APMSqueeze(p, lr=0.1, warmup_steps=5, compress="preconditioned")
    opt = APMSqueeze(p, lr=0.1, warmup_steps=5)
    with pytest.raises(ValueError, match="eps"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "eps": 0.0})


@pytest.mark.parametrize("mask_unseen", [True, False])
def test_coordinates_without_warmup_gradient(mask_unseen):
    """v_Tw = 0 where no gradient arrived in warmup: the 1-bit m̄ still gives such coordinates
    ±scale, and m̄ / ε throws them far (the paper's update); mask_unseen leaves them alone."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(64))
    opt = APMSqueeze([p], lr=0.01, warmup_steps=5, mask_unseen=mask_unseen)
    for _ in range(7):                                                # 5 warmup steps, 2 compressed
        p.grad = torch.randn(64, generator=gen)
        p.grad[:8] = 0.0
        opt.step()
    assert float(p.detach()[8:].abs().max()) < 0.1                   # seen coordinates: Adam-sized steps
    if mask_unseen:
        assert torch.equal(p.detach()[:8], torch.zeros(8))
    else:
        assert float(p.detach()[:8].abs().min()) > 1e3                # ~ lr * scale / eps


# ---- one process: layouts and dtypes ------------------------------------------------------------

def test_non_contiguous_parameters_step_like_contiguous_ones():
    """A channels_last conv weight and a transposed matrix (non-contiguous gradients too) move
    bit for bit like contiguous copies, through warmup and compressed steps."""
    gen = torch.Generator().manual_seed(0)
    conv, mat = torch.randn(4, 3, 3, 3, generator=gen), torch.randn(5, 6, generator=gen).t()
    odd = [torch.nn.Parameter(conv.contiguous(memory_format=torch.channels_last)), torch.nn.Parameter(mat.clone())]
    plain = [torch.nn.Parameter(conv.clone()), torch.nn.Parameter(mat.contiguous())]
    assert not odd[0].is_contiguous() and not odd[1].is_contiguous()
    opts = [APMSqueeze(ps, lr=0.01, warmup_steps=5, weight_decay=0.1) for ps in (odd, plain)]
    for _ in range(8):                                                # 5 warmup steps, 3 compressed
        grads = [torch.randn(p.shape, generator=gen) for p in plain]
        odd[0].grad, odd[1].grad = grads[0].contiguous(memory_format=torch.channels_last), grads[1].t().contiguous().t()
        plain[0].grad, plain[1].grad = grads[0].clone(), grads[1].clone()
        for opt in opts:
            opt.step()
        for a, b in zip(odd, plain):
            assert torch.equal(a, b)
    assert opts[0].phase == "compressed" and opts[0].comm_stats.last_step.collectives == 2


def test_bf16_parameters_keep_float32_state_through_a_checkpoint():
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen).to(torch.bfloat16))]
    opt = APMSqueeze(params, lr=0.01, warmup_steps=5)
    for _ in range(6):                                                # 5 warmup steps, 1 compressed
        params[0].grad = torch.randn(8, 8, generator=gen).to(torch.bfloat16)
        opt.step()
    saved = opt.state_dict()
    fresh = APMSqueeze(params, lr=0.01, warmup_steps=5)
    fresh.load_state_dict(saved)
    state = fresh.state[params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert fresh.worker_error.dtype == torch.float32 and fresh.steps_done == 6
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key], opt.state[params[0]][key])


def test_frozen_and_empty_parameters_are_not_part_of_the_message():
    """Layout = requires_grad and numel > 0: here P = 2 of the 4 parameters, so the warmup
    all-reduce carries 4 * (numel + 1 + 16 + 2) bytes, and frozen / empty ones are untouched."""
    live = [torch.nn.Parameter(torch.ones(3, 5)), torch.nn.Parameter(torch.ones(7))]
    frozen, empty = torch.nn.Parameter(torch.ones(4), requires_grad=False), torch.nn.Parameter(torch.ones(0))
    opt = APMSqueeze([live[0], frozen, empty, live[1]], lr=0.1, warmup_steps=5)
    for p in live:
        p.grad = torch.ones_like(p)
    for _ in range(5):                                               # the warmup
        opt.step()
        assert opt.comm_stats.last_step.payload_bytes == 4 * (15 + 7 + 1 + 16 + 2)
    assert torch.equal(frozen, torch.ones(4)) and frozen not in opt.state and empty not in opt.state
    opt.step()                                                       # compressed: N = 24 (22 padded to 8)
    # W = 1: only the all_gather is handed over; scale='tensor': 3 scales (15, 7 and the 2 padding values)
    assert opt.comm_stats.last_step.payload_bytes == 4 * 3 + 24 // 8
