"""LoRDO on real gloo groups (world sizes 1 and 3) and in-process: the paper's equations
against an independent single-process simulation of W workers, AdamW equivalence where it
holds, moment shapes, basis refresh, the nonfinite policy at and between syncs (anchor and
sync error untouched), bad arguments.

The shared suite (test_suite.py) checks 'lordo' (fp32 wire) for everything every optimizer
owes, bad peers and a NaN carried from a local step to the sync included; and, at world
sizes 1 and 3, the options 'lordo' leaves at their defaults (registry.py's VARIANTS: int8
and bf16 wires, outer learning rate and momentum, no error feedback, weight decay) for
replicas and resume after 50 steps (K divides 50) and every step's bytes.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from tests.dist import outcome_of
from tests.optim import problem
from tests.optim.suite import on_world
from thinwire.ops import lowrank
from thinwire.optim.lordo import LoRDO

REF = {"lr": 0.01, "rank": 3, "sync_every": 4, "omega": 0.8, "clip": 0.5, "betas": (0.9, 0.95), "eps": 1e-8,
       "weight_decay": 0.01}
REF_STEPS = 12
WORLDS = [1, 3]


NAN_CASES = {   # name: (wire, nonfinite, step whose gradient is NaN on the last rank; K = 2: step 1 syncs)
    "fp32-sync": ("fp32", "raise", 1), "int8-sync": ("int8", "raise", 1), "fp32-carried": ("fp32", "raise", 0),
    "int8-skip-sync": ("int8", "skip", 1), "fp32-skip-sync": ("fp32", "skip", 1), "fp32-skip-local": ("fp32", "skip", 0),
}


def _nan_on_last_rank(rank, world, wire, nonfinite, nan_step):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(12, 8))
    initial = p.detach().clone()
    opt = LoRDO([p], rank=2, sync_every=2, wire=wire, nonfinite=nonfinite)
    gen = torch.Generator().manual_seed(rank)
    statuses, after_first_sync = [], None
    for step in range(4):
        p.grad = torch.randn(p.shape, generator=gen)
        if step == nan_step and rank == world - 1:
            p.grad[3, 5] = float("nan")
        statuses.append(outcome_of(opt.step)[0])
        if step == 1:
            after_first_sync = {k: opt.state[p][k].clone() for k in ("anchor", "sync_error") if k in opt.state[p]}
    return {"statuses": statuses, "initial": initial, "after_first_sync": after_first_sync,
            "final": p.detach().clone()}


def _reference_run(rank, world):
    model = problem.make_model()
    opt = LoRDO(list(model.parameters()), **REF)
    for step in range(REF_STEPS):
        x, y = problem.batch(rank, step)
        problem.loss_on(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    moments = [(opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in model.parameters()]
    return {"params": problem.flat_params(model), "moments": moments}


def suite(rank, world):
    nan = {name: _nan_on_last_rank(rank, world, *case) for name, case in NAN_CASES.items()}
    return {"nan": nan, "reference": _reference_run(rank, world)}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def outcome(request):
    return request.param, on_world(suite, request.param, timeout=300)


# ---- the equations, against an independent simulation of W workers -------------------------

def simulate(world: int):
    """The paper's local step and sync for W workers in one process, written from the
    equations (module docstring of lordo.py), in float32."""
    lr, r, k, om, rho, (b1, b2), eps, wd = (REF[x] for x in ("lr", "rank", "sync_every", "omega", "clip",
                                                            "betas", "eps", "weight_decay"))
    models = [problem.make_model() for _ in range(world)]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    st = [[{} for _ in anchor] for _ in range(world)]
    for t in range(1, REF_STEPS + 1):
        for m, model in enumerate(models):
            x, y = problem.batch(m, t - 1)
            grads = torch.autograd.grad(problem.loss_on(model, x, y), list(model.parameters()))
            with torch.no_grad():
                for i, (p, g) in enumerate(zip(model.parameters(), grads)):
                    s = st[m][i]
                    g = g * min(1.0, rho / float(g.norm()))
                    p.mul_(1 - lr * wd)
                    if p.dim() == 1:
                        s.setdefault("u", torch.zeros_like(p)), s.setdefault("v", torch.zeros_like(p))
                        s["u"] = b1 * s["u"] + (1 - b1) * g
                        s["v"] = b2 * s["v"] + (1 - b2) * g * g
                        p.sub_(lr * (s["u"] / (1 - b1 ** t)) / ((s["v"] / (1 - b2 ** t)).sqrt() + eps))
                        continue
                    rows, cols = p.shape
                    right = rows >= cols
                    s.setdefault("Q", torch.eye(cols if right else rows)[:, :r])
                    s.setdefault("E", torch.zeros_like(p))
                    q, a = s["Q"], g + s["E"]
                    low = a @ q if right else q.T @ a
                    s["E"] = a - (low @ q.T if right else q @ low)
                    s.setdefault("u", torch.zeros_like(low)), s.setdefault("v", torch.zeros_like(low))
                    s["u"] = b1 * s["u"] + (1 - b1) * low
                    s["v"] = b2 * s["v"] + (1 - b2) * low * low
                    d = (s["v"] / (1 - b2 ** t)).sqrt() + eps
                    n = s["u"] / (1 - b1 ** t) / d
                    p.sub_(lr * (om * (n @ q.T if right else q @ n) + (1 - om) * g / d.mean()))
        if t % k == 0:
            with torch.no_grad():
                for i in range(len(anchor)):
                    delta = torch.stack([list(mm.parameters())[i] - anchor[i] for mm in models]).mean(0)
                    anchor[i] = anchor[i] + delta
                    for m, model in enumerate(models):
                        list(model.parameters())[i].copy_(anchor[i])
                        s = st[m][i]
                        if "Q" not in s:
                            continue
                        right = delta.shape[0] >= delta.shape[1]
                        uu, _, vh = torch.linalg.svd(delta, full_matrices=False)
                        q_new = vh[:r].T if right else uu[:, :r]
                        c = s["Q"].T @ q_new
                        s["u"] = s["u"] @ c if right else c.T @ s["u"]
                        s["v"] = s["v"] @ (c * c) if right else (c * c).T @ s["v"]
                        s["Q"] = q_new
    return [problem.flat_params(mm) for mm in models], st


def test_matches_independent_simulation(outcome):
    world, results = outcome
    params, states = simulate(world)
    for m, result in enumerate(results):
        torch.testing.assert_close(result["reference"]["params"], params[m], rtol=1e-4, atol=1e-6)
        assert torch.equal(result["reference"]["params"], results[0]["reference"]["params"])  # synced at 12
        for i, (u, v) in enumerate(result["reference"]["moments"]):   # per-rank moments differ by design
            torch.testing.assert_close(u, states[m][i]["u"], rtol=1e-3, atol=1e-7)
            torch.testing.assert_close(v, states[m][i]["v"], rtol=1e-3, atol=1e-9)


# ---- nonfinite gradients -----------------------------------------------------------------

@pytest.mark.parametrize("case", ["fp32-sync", "int8-sync", "fp32-carried"])
def test_nonfinite_raises_on_every_rank_at_the_sync(outcome, case):
    """A NaN at the sync step, or at a local step ('raise' carries it to the next sync):
    every rank raises at the sync, and the next sync goes through."""
    _, results = outcome
    assert all(r["nan"][case]["statuses"] == ["ok", "NonFiniteGradientError", "ok", "ok"] for r in results), \
        [r["nan"][case]["statuses"] for r in results]
    assert all(torch.equal(r["nan"][case]["after_first_sync"]["anchor"], r["nan"][case]["initial"]) for r in results)
    assert all(torch.equal(r["nan"][case]["final"], results[0]["nan"][case]["final"]) for r in results)


@pytest.mark.parametrize("case", ["int8-skip-sync", "fp32-skip-sync"])
def test_nonfinite_skip_at_the_sync_keeps_going_and_the_next_sync_joins_the_replicas(outcome, case):
    """int8: the sync read on the host; fp32: landed under the device's verdict (no host read)."""
    _, results = outcome
    for r in results:
        got = r["nan"][case]
        assert got["statuses"] == ["ok"] * 4
        assert torch.equal(got["final"], results[0]["nan"][case]["final"])
        # the sync was not made: anchor and error feedback as before it
        assert torch.equal(got["after_first_sync"]["anchor"], got["initial"])
        assert not got["after_first_sync"].get("sync_error", torch.zeros(1)).any()


def test_nonfinite_skip_at_a_local_step_skips_it_on_that_rank_only(outcome):
    """The bad rank's local step moves nothing (on the device); the sync goes through and
    joins the replicas."""
    _, results = outcome
    for r in results:
        got = r["nan"]["fp32-skip-local"]
        assert got["statuses"] == ["ok"] * 4
        assert torch.equal(got["final"], results[0]["nan"]["fp32-skip-local"]["final"])
        assert not torch.equal(got["after_first_sync"]["anchor"], got["initial"])


# ---- in-process properties ---------------------------------------------------------------

def _train_one_rank(opt, model, steps):
    for step in range(steps):
        x, y = problem.batch(0, step)
        problem.loss_on(model, x, y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:LoRDO rank")
def test_full_rank_omega1_no_clip_before_refresh_is_adamw():
    """rank = min(p, q), ω = 1, clip off, one rank, no sync yet: Q is the identity, E = 0,
    so every step is torch.optim.AdamW's. (Why later syncs are not: module docstring.)"""
    ours, theirs = problem.make_model(), problem.make_model()
    opt = LoRDO(list(ours.parameters()), lr=0.01, rank=37, sync_every=1000, omega=1.0, clip=None,
                betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    ref = torch.optim.AdamW(list(theirs.parameters()), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    _train_one_rank(opt, ours, 30)
    _train_one_rank(ref, theirs, 30)
    torch.testing.assert_close(problem.flat_params(ours), problem.flat_params(theirs), rtol=1e-6, atol=1e-7)


def test_low_rank_moment_shapes():
    tall, wide = torch.nn.Parameter(torch.randn(40, 12)), torch.nn.Parameter(torch.randn(6, 30))
    vec = torch.nn.Parameter(torch.randn(30))
    opt = LoRDO([tall, wide, vec], rank=3, sync_every=2)
    for _ in range(2):                                       # through one refresh
        for p in (tall, wide, vec):
            p.grad = torch.randn_like(p)
        opt.step()
    for p, moment, basis in ((tall, (40, 3), (12, 3)), (wide, (3, 30), (6, 3))):   # p x r  /  r x q
        assert opt.state[p]["exp_avg"].shape == moment and opt.state[p]["exp_avg_sq"].shape == moment
        assert opt.state[p]["Q"].shape == basis
        q = opt.state[p]["Q"]
        torch.testing.assert_close(q.T @ q, torch.eye(3), atol=1e-5, rtol=0)
    assert opt.state[vec]["exp_avg"].shape == (30,)


def test_refresh_spans_top_singular_vectors_and_keeps_full_rank_momentum():
    torch.manual_seed(3)
    delta = torch.randn(20, 8)
    u, s, vh = torch.linalg.svd(delta.double())
    q = lowrank.top_singular_basis(delta, 3, "right")
    torch.testing.assert_close((q @ q.T).double(), vh[:3].T @ vh[:3], atol=1e-5, rtol=0)   # same subspace
    q_full_old, q_full_new = torch.linalg.qr(torch.randn(8, 8))[0], lowrank.top_singular_basis(delta, 8, "right")
    m = torch.randn(20, 8)
    u_new, v_new = lowrank.rotate_moments(m, m.abs(), q_full_old, q_full_new, "right")
    torch.testing.assert_close(u_new @ q_full_new.T, m @ q_full_old.T, atol=1e-5, rtol=0)   # u Qᵀ unchanged
    assert bool((v_new >= 0).all())


def test_rank_clamped_with_one_warning():
    a, b = torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(3, 6))
    opt = LoRDO([a, b], rank=16)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert len([w for w in caught if "clamped" in str(w.message)]) == 1
    assert opt.state[a]["Q"].shape == (4, 4) and opt.state[b]["Q"].shape == (3, 3)


@pytest.mark.parametrize("kwargs, name", [
    ({"rank": 0}, "rank"), ({"rank": 2.5}, "rank"), ({"sync_every": 0}, "sync_every"),
    ({"omega": 1.5}, "omega"), ({"omega": -0.1}, "omega"), ({"clip": 0.0}, "clip"), ({"clip": -1.0}, "clip"),
    ({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1.0}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"wire": "fp8"}, "wire"), ({"outer_lr": 0.0}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LoRDO([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)
    if name in ("rank", "omega", "clip"):        # per-group values are checked too
        opt = LoRDO([torch.nn.Parameter(torch.randn(4, 4))])
        with pytest.raises(ValueError, match=name):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], **kwargs})


# ---- layouts: strides, empty parameters, missing gradients, bf16 -----------------------------

def _strided_pair():
    """A channels_last conv weight, a transposed matrix and a vector; and contiguous twins."""
    torch.manual_seed(5)
    conv = torch.randn(6, 3, 3, 3).to(memory_format=torch.channels_last)
    wide = torch.randn(9, 5).t()                       # 5 x 9, strides (1, 5)
    vec = torch.randn(7)
    strided = [torch.nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in (conv, wide, vec)]
    plain = [torch.nn.Parameter(t.contiguous()) for t in (conv, wide, vec)]
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous()
    return strided, plain


def _run_with_grads(opt, params, steps, seed=0, skip=None):
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            p.grad = None if skip and skip(step, i) else g.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_non_contiguous_parameters_step_like_contiguous_ones(wire):
    strided, plain = _strided_pair()
    kwargs = dict(lr=0.01, rank=2, sync_every=3, weight_decay=0.1, wire=wire, outer_momentum=0.5)
    _run_with_grads(LoRDO(strided, **kwargs), strided, 7)
    _run_with_grads(LoRDO(plain, **kwargs), plain, 7)
    for s, p in zip(strided, plain):
        torch.testing.assert_close(s.detach(), p.detach(), rtol=1e-6, atol=1e-7)
    assert strided[0].is_contiguous(memory_format=torch.channels_last)       # strides kept


def test_zero_element_parameters_are_left_out():
    empty, matrix = torch.nn.Parameter(torch.randn(0, 5)), torch.nn.Parameter(torch.randn(6, 4))
    opt = LoRDO([empty, matrix], rank=2, sync_every=2)
    _run_with_grads(opt, [empty, matrix], 4)
    assert not opt.state[empty] and "Q" in opt.state[matrix]
    # the sync message holds one parameter: 24 deltas + 1 flag + 16 step slots + 1 presence float
    assert opt.comm_stats.by_tag["payload"].as_dict()["payload_bytes"] == 2 * 4 * (24 + 1 + 16 + 1)


def test_parameter_without_gradient_takes_no_local_step_but_is_synced():
    """No gradient on local steps: no moments, no weight decay, no move; at the sync its
    delta (zero at one rank) is averaged like every other parameter's."""
    torch.manual_seed(2)
    a, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))
    before = b.detach().clone()
    opt = LoRDO([a, b], rank=2, sync_every=4, weight_decay=0.5)
    _run_with_grads(opt, [a, b], 3, skip=lambda step, i: i == 1)
    assert torch.equal(b.detach(), before) and opt.state[b]["step"] == 0 and not opt.state[b]["exp_avg"].any()
    assert opt.state[a]["step"] == 3
    _run_with_grads(opt, [a, b], 1, skip=lambda step, i: i == 1)           # the sync
    assert torch.equal(b.detach(), before) and torch.equal(opt.state[b]["anchor"], before)


def test_bf16_parameters_keep_float32_state_through_a_checkpoint():
    """State is float32 beside bf16 parameters (the anchor has the parameter's dtype), stays
    so through state_dict / load_state_dict, and the resumed run continues bit-identically."""
    torch.manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(8, 6, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16))]
    opt = LoRDO(params, rank=2, sync_every=3, wire="bf16")
    _run_with_grads(opt, params, 2)
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = LoRDO(twins, rank=2, sync_every=3, wire="bf16")
    fresh.load_state_dict(torch.load(blob, weights_only=False))
    for p, twin in zip(params, twins):
        assert opt.state[p]["exp_avg"].dtype == torch.float32 and opt.state[p]["anchor"].dtype == torch.bfloat16
        for key, saved in opt.state[p].items():
            if torch.is_tensor(saved):
                loaded = fresh.state[twin][key]
                assert loaded.dtype == saved.dtype and torch.equal(loaded, saved), key
    assert fresh.steps_done == 2
    _run_with_grads(opt, params, 5, seed=1)                     # through the syncs at steps 3 and 6
    _run_with_grads(fresh, twins, 5, seed=1)
    for p, twin in zip(params, twins):
        assert torch.equal(p, twin)
