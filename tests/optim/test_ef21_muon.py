"""EF21Muon: reduces to torch.optim.Muon, matches an independent simulation of the paper's
equations, both topologies give one trajectory, nonfinite gradients leave the state alone,
bad arguments.

The shared suite (test_suite.py) checks 'ef21-server' and 'ef21-replicated' (identity+bf16 up)
for everything every optimizer owes, bad peers and the nonfinite status included; and the
compressors those leave at their defaults (registry.py's VARIANTS: Top-K with natural values,
Rand-K, DCT-Top-K with int8 values, rank-K, at world sizes 1 and 3) for replicas, resume,
loss and every step's bytes.

Expected values come from torch.optim.Muon, from the simulation written below (sorting
for Top-K, torch's own Newton-Schulz), and from message sizes derived by hand from the
documented wire format: every uplink and downlink message is the protocol prefix (an 8-byte
header, then a presence bitmap of ceil(P / 8) bytes for the P parameters that take part:
requires_grad and at least one element) followed by the compressors' payloads.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from tests.dist import outcome_of, run_workers
from tests.optim import problem
from thinwire.optim.ef21_muon import EF21Muon

NS = dict(ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7)
SPAWNED = 3


def prefix(n_params):
    """Header (8 bytes) + presence bitmap (one bit per parameter, whole bytes)."""
    return 8 + math.ceil(n_params / 8)


# ---- reduction to Muon, one process ------------------------------------------------------
def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 64, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(64, 10, bias=False))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_identity_single_worker_is_torch_muon_bit_for_bit(weight_decay):
    ours, ref = _mlp(), _mlp()
    # beta = 0.125: 1 - (1 - 0.125) == 0.125 exactly, so both lerp with the same weight
    opt = EF21Muon(ours.parameters(), lr=0.02, beta=0.125, weight_decay=weight_decay, uplink="identity",
                   downlink="identity")
    muon = torch.optim.Muon(ref.parameters(), lr=0.02, momentum=0.875, nesterov=False, weight_decay=weight_decay,
                            adjust_lr_fn="original")
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        x, y = torch.randn(32, 24, generator=gen), torch.randn(32, 10, generator=gen)
        for model, o in ((ours, opt), (ref, muon)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
            o.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    state = opt.state[next(iter(ours.parameters()))]
    assert set(state) == {"momentum", "estimate", "server_estimate", "server_model"}


def test_layerwise_lmos_and_conv_flattening():
    conv = torch.nn.Parameter(torch.randn(6, 3, 2, 2))
    vec, emb = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(7, 4))
    start = [t.detach().clone() for t in (conv, vec, emb)]
    opt = EF21Muon([{"params": [conv]}, {"params": [vec], "lmo": "rms"}, {"params": [emb], "lmo": "sign", "lr": 0.5}],
                   lr=0.1, beta=1.0, uplink="identity", downlink="identity")
    grads = [torch.randn_like(t) for t in (conv, vec, emb)]
    for t, g in zip((conv, vec, emb), grads):
        t.grad = g.clone()
    opt.step()
    # beta = 1: G = the gradient. conv: 6 x 12 matrix, wide, scale 1
    ns = _zeropower_via_newtonschulz(grads[0].reshape(6, 12), **NS).reshape(6, 3, 2, 2)
    torch.testing.assert_close(conv.detach(), start[0] - 0.1 * ns.float())
    assert torch.allclose(vec.detach(), start[1] - 0.1 * math.sqrt(5) * grads[1] / grads[1].norm())
    assert torch.equal(emb.detach(), start[2] - 0.5 * grads[2].sign())


@pytest.mark.parametrize("kwargs, name", [
    ({"lr": -1.0}, "lr"), ({"beta": 0.0}, "beta"), ({"beta": 1.5}, "beta"), ({"lmo": "adam"}, "lmo"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"topology": "ring"}, "topology"), ({"uplink": "gzip"}, "uplink"),
    ({"uplink": "topk:0"}, "uplink"), ({"downlink": "randk:2"}, "downlink"), ({"downlink": "rank:0"}, "downlink"),
    ({"nonfinite": "ignore"}, "nonfinite"), ({"seed": 1.5}, "seed"), ({"lmo": "spectral"}, "spectral"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(ValueError, match=name):
        EF21Muon(params, **kwargs)


# ---- multi-process: dense Muon, the simulation, topologies ------------------------------
def _train(rank, model, opt, steps):
    for step in range(steps):
        x, y = problem.batch(rank, step)
        problem.loss_on(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return problem.flat_params(model)


def _agreement_worker(rank, world):
    import thinwire
    out = {}
    mlp = lambda: torch.nn.Sequential(torch.nn.Linear(24, 37, bias=False), torch.nn.Tanh(),  # noqa: E731
                                      torch.nn.Linear(37, 10, bias=False))
    torch.manual_seed(0)
    model = mlp()
    out["ef21-identity"] = _train(rank, model, EF21Muon(model.parameters(), lr=0.02, beta=0.125, uplink="identity",
                                                        downlink="identity"), 10)
    torch.manual_seed(0)
    model = mlp()
    dense = thinwire.DenseAllReduce(torch.optim.Muon(model.parameters(), lr=0.02, momentum=0.875, nesterov=False,
                                                     weight_decay=0.0, adjust_lr_fn="original"))
    out["dense-muon"] = _train(rank, model, dense, 10)
    for topology in ("server", "replicated"):
        model = problem.make_model()
        opt = EF21Muon(model.parameters(), lr=0.02, beta=0.1, uplink="topk:0.1", downlink="identity+bf16",
                       topology=topology)
        out[f"topk-{topology}"] = _train(rank, model, opt, 8)
        out[f"server-state-{topology}"] = sorted(opt.state[next(model.parameters())])
        out[f"partial-{topology}"] = _partial_presence(rank, topology)
        model = problem.make_model()
        opt = EF21Muon(model.parameters(), lr=0.02, uplink="randk:0.2+natural", downlink="dct-topk:4:8+int8",
                       topology=topology, seed=3)
        out[f"random-{topology}"] = _train(rank, model, opt, 8)
    return out


def _partial_presence(rank, topology):
    """a: a gradient on every rank; b: on rank 1 only; c: on no rank. Returns (start, end)."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(6, 5)) for _ in range(3))
    start = [t.detach().clone() for t in (a, b, c)]
    opt = EF21Muon([a, b, c], lr=0.05, beta=0.5, uplink="topk:0.3+natural", downlink="topk:0.5", topology=topology)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        a.grad = torch.randn(6, 5, generator=gen)
        b.grad = torch.randn(6, 5, generator=gen) if rank == 1 else None
        opt.step()
    untouched = not opt.state[c]["momentum"].any() and not opt.state[c]["estimate"].any()
    return start, [t.detach().clone() for t in (a, b, c)], untouched


def _spawned_worker(rank, world):
    return {"agreement": _agreement_worker(rank, world), "failures": _failures_worker(rank, world)}


@pytest.fixture(scope="module")
def spawned():
    """One spawn of SPAWNED gloo workers for the agreement and nonfinite checks: on this
    shared 2-core machine a spawn costs ~10 s, so everything shares it."""
    return run_workers(_spawned_worker, SPAWNED, timeout=400)


@pytest.fixture(scope="module")
def agreement(spawned):
    return [r["agreement"] for r in spawned]


def test_several_workers_identity_equals_dense_allreduce_muon(agreement):
    for rank_result in agreement:   # same math, different summation order: a few float32 ulps
        torch.testing.assert_close(rank_result["ef21-identity"], rank_result["dense-muon"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["topk", "random"])
def test_topologies_give_the_same_trajectory_bit_for_bit(agreement, kind):
    for rank_result in agreement:
        assert torch.equal(rank_result[f"{kind}-server"], rank_result[f"{kind}-replicated"])
    assert torch.equal(agreement[0][f"{kind}-server"], agreement[1][f"{kind}-server"])


def test_a_gradient_on_some_ranks_moves_a_parameter_on_all_and_none_moves_none(agreement):
    for topology in ("server", "replicated"):
        (start, end, untouched), *others = [r[f"partial-{topology}"] for r in agreement]
        assert not torch.equal(end[0], start[0]) and not torch.equal(end[1], start[1])
        assert torch.equal(end[2], start[2]) and untouched
        for _, other_end, other_untouched in others:               # replicas agree bit for bit
            assert all(torch.equal(x, y) for x, y in zip(end, other_end)) and other_untouched
        assert all(torch.equal(x, y) for x, y in zip(end, agreement[0]["partial-server"][1]))


def test_only_the_server_holds_the_server_state(agreement):
    for rank, result in enumerate(agreement):
        assert result["server-state-replicated"] == ["estimate", "momentum", "server_estimate", "server_model"]
        assert result["server-state-server"] == (["estimate", "momentum", "server_estimate", "server_model"]
                                                 if rank == 0 else ["estimate", "momentum"])


def _topk(x, ratio):
    """Independent Top-K: keep the round(ratio * d) largest magnitudes, found by sorting."""
    flat = x.flatten()
    keep = flat.abs().argsort(descending=True)[: max(1, round(ratio * flat.numel()))]
    out = torch.zeros_like(flat)
    out[keep] = flat[keep]
    return out.view_as(x)


def _lmo(g):
    if g.dim() >= 2:
        return _zeropower_via_newtonschulz(g, **NS).float() * math.sqrt(max(1, g.shape[0] / g.shape[1]))
    return g * math.sqrt(g.numel()) / g.norm()        # rms LMO for the biases


def test_matches_an_independent_simulation_of_the_equations(agreement):
    """The paper's equations for n workers in one process: M_j, G_j per worker; G, X, W.
    (Top-K on the downlink is left to the topology test: X - W after a step is a multiple of
    a bf16 matrix, full of ties that sorting and torch.topk may break differently.)"""
    n = len(agreement)
    model = problem.make_model()
    w = [p.detach().clone() for p in model.parameters()]
    x = [t.clone() for t in w]
    g_server = [torch.zeros_like(t) for t in w]
    m = [[torch.zeros_like(t) for t in w] for _ in range(n)]
    g_worker = [[torch.zeros_like(t) for t in w] for _ in range(n)]
    for step in range(8):
        r = [[None] * len(w) for _ in range(n)]
        for j in range(n):
            with torch.no_grad():
                for p, t in zip(model.parameters(), w):
                    p.copy_(t)
            model.zero_grad()
            problem.loss_on(model, *problem.batch(j, step)).backward()
            for i, p in enumerate(model.parameters()):
                m[j][i] = torch.lerp(m[j][i], p.grad, 0.1)       # (1 - beta) M + beta grad
                r[j][i] = _topk(m[j][i] - g_worker[j][i], 0.1)
                g_worker[j][i] = g_worker[j][i] + r[j][i]
        for i in range(len(w)):
            g_server[i] = g_server[i] + sum(r[j][i] for j in range(n)) / n
            x[i] = x[i] - 0.02 * _lmo(g_server[i])
            w[i] = w[i] + (x[i] - w[i]).bfloat16().float()     # downlink: S in bf16
    simulated = torch.cat([t.reshape(-1) for t in w])
    torch.testing.assert_close(agreement[0]["topk-server"], simulated, rtol=1e-4, atol=1e-5)


# ---- nonfinite gradients -----------------------------------------------------------------


def _failures_worker(rank, world):
    out = {}
    for topology in ("server", "replicated"):
        for policy in ("raise", "skip"):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(16, 16))
            opt = EF21Muon([p], uplink="topk:0.1", topology=topology, nonfinite=policy)
            before = p.detach().clone()
            p.grad = torch.randn_like(p)
            if rank == world - 1:
                p.grad[2, 3] = float("inf")
            status = outcome_of(opt.step)
            state = opt.state[p]                        # M_j, G_j, G still zero, X still W
            zeros = [state[k] for k in ("momentum", "estimate", "server_estimate") if k in state]
            unchanged = (torch.equal(p.detach(), before) and not any(t.any() for t in zeros)
                         and torch.equal(state.get("server_model", before), before))
            p.grad = torch.ones_like(p)                 # the next step works: nobody is stuck
            out[topology, policy] = (status[0], unchanged, outcome_of(opt.step)[0], p.detach().clone(), status[1])
    return out


@pytest.fixture(scope="module")
def failures(spawned):
    return [r["failures"] for r in spawned]


@pytest.mark.parametrize("topology", ["server", "replicated"])
def test_nonfinite_gradient_is_an_error_on_every_rank_and_changes_nothing(failures, topology):
    raised = [r[topology, "raise"] for r in failures]
    assert [r[:3] for r in raised] == [("NonFiniteGradientError", True, "ok")] * len(failures), raised[0][4]
    skipped = [r[topology, "skip"] for r in failures]
    assert [r[:3] for r in skipped] == [("ok", True, "ok")] * len(failures), skipped[0][4]
    assert all(torch.equal(r[3], skipped[0][3]) for r in skipped + raised)


def test_compressor_objects_are_accepted():
    from thinwire.compress import ChunkedTopK
    from thinwire.compress.sparse import TopK
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = EF21Muon([p], uplink=TopK(0.25, "natural"), downlink=ChunkedTopK(4, 4, "dct", "int8"))
    assert (opt.uplink.name, opt.downlink.name) == ("topk:0.25+natural", "dct-topk:4:4+int8")
    p.grad = torch.randn_like(p)
    opt.step()
    # 16 of 64 values: a 64-bit bitmap (8 bytes < 16 6-bit indices, 12 bytes) + 2 sign bytes
    # + 16 exponent bytes, after the prefix (8-byte header + 1 byte of presence for 1 parameter)
    assert opt.comm_stats.by_tag["payload"].payload_bytes == (8 + 1) + 8 + 2 + 16


def test_frozen_empty_and_gradless_parameters_are_left_alone():
    """The message covers the P = 9 trainable, non-empty parameters only: a 2-byte bitmap."""
    torch.manual_seed(0)
    vectors = [torch.nn.Parameter(torch.randn(3)) for _ in range(9)]
    frozen = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    empty = torch.nn.Parameter(torch.empty(0, 5))
    idle = vectors[-1]                                             # never gets a gradient
    start = [t.detach().clone() for t in (frozen, empty, idle)]
    trained = [v.detach().clone() for v in vectors[:-1]]
    opt = EF21Muon([frozen, empty, *vectors], lr=0.1, uplink="identity+bf16", downlink="identity+bf16")
    empty.grad = torch.empty(0, 5)
    for _ in range(2):
        for v in vectors[:-1]:
            v.grad = torch.randn(3)
        opt.step()
    assert all(torch.equal(t.detach(), s) for t, s in zip((frozen, empty, idle), start))
    assert frozen not in opt.state and empty not in opt.state
    assert not opt.state[idle]["momentum"].any() and torch.equal(opt.state[idle]["server_model"], start[2])
    assert all(not torch.equal(v.detach(), t) for v, t in zip(vectors[:-1], trained))
    message = prefix(9) + 2 * 3 * 9                                # bf16: 2 bytes per element
    assert prefix(9) == 10
    assert opt.comm_stats.last_step.as_dict() == {"payload_bytes": 2 * message, "link_bytes_sent": 0,
                                                  "link_bytes_received": 0, "collectives": 2}
    assert opt.comm_stats.by_tag["downlink"].payload_bytes == 2 * message


@pytest.mark.parametrize("topology", ["server", "replicated"])
@pytest.mark.parametrize("uplink, downlink", [("topk:0.2+natural", "identity"), ("rank:2", "dct-topk:4:4+int8"),
                                              ("randk:0.3", "topk:0.5+bf16")])
def test_non_contiguous_parameters_step_as_their_contiguous_twins(topology, uplink, downlink):
    """A channels_last conv weight and a transposed matrix take the same steps, bit for bit,
    as contiguous copies, and keep their memory layout."""
    torch.manual_seed(0)
    shapes = [(6, 3, 3, 3), (10, 6), (6,)]
    values = [torch.randn(s) for s in shapes]
    strided = [torch.nn.Parameter(values[0].to(memory_format=torch.channels_last)),
               torch.nn.Parameter(values[1].t().contiguous().t()), torch.nn.Parameter(values[2].clone())]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous()
    opts = [EF21Muon(ps, lr=0.05, beta=0.5, uplink=uplink, downlink=downlink, topology=topology, seed=5)
            for ps in (strided, plain)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for ps, opt in zip((strided, plain), opts):
            for p, g in zip(ps, grads):
                p.grad = torch.empty_like(p).copy_(g)              # the parameter's own layout
            opt.step()
        for p, q in zip(strided, plain):
            assert torch.equal(p.detach(), q.detach())
    assert strided[0].is_contiguous(memory_format=torch.channels_last) and strided[1].stride() == (1, 10)
