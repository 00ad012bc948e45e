"""EF21-Muon under nonfinite='skip' with no host read (`_apply_masked`, and DeviceRelay's
deferred verdict under topology='server'): every step lands bit for bit as the host-read skip
does (parameters, M_j, G_j and the server's G, X), through a NaN step on one rank; the skip is
reported at the next call, and a malformed uplink raises on every rank one call later with
nothing applied. Real gloo processes, world 2."""

import pytest
import torch

import thinwire

from ..dist import run_workers
from .test_verdict import _until_error

SHAPES = [(64, 32), (32, 32), (32,), (48, 32)]
BAD_STEP, STEPS = 3, 6
BUILDS = {                                            # the default downlink is lossless (W ← X)
    "server": dict(),
    "server-lossy-down": dict(downlink="topk:0.1"),
    "replicated": dict(topology="replicated"),
    "lossless-up": dict(uplink="identity", downlink="topk:0.1+bf16"),
    "bf16": dict(dtype=torch.bfloat16),
}


def _params(dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _build(name, params, host: bool):
    kw = {k: v for k, v in BUILDS[name].items() if k != "dtype"}
    opt = thinwire.EF21Muon(params, lr=0.02, weight_decay=0.1, nonfinite="skip", **kw)
    if host:                                          # the host-read landing every algorithm has
        opt._applies_masked = lambda layout: False
    return opt


def _state(opt) -> list[torch.Tensor]:
    return [t.clone() for p in opt.params for t in opt.state[p].values() if torch.is_tensor(t)]


def _train_both(rank, world, name):
    dtype = BUILDS[name].get("dtype", torch.float32)
    ours, theirs = _params(dtype), _params(dtype)
    fast, slow = _build(name, ours, host=False), _build(name, theirs, host=True)
    gen, agree, moved_at_bad = torch.Generator().manual_seed(rank), [], None
    for step in range(STEPS):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen).to(dtype)
            if step == BAD_STEP and rank == 1:
                a.grad[0] = float("nan")
            b.grad = a.grad.clone()
        before = [p.detach().clone() for p in ours], _state(fast)
        fast.step()
        slow.step()
        agree.append((all(torch.equal(a, b) for a, b in zip(ours, theirs)),
                      all(torch.equal(a, b) for a, b in zip(_state(fast), _state(slow)))))
        if step == BAD_STEP:
            moved_at_bad = (any(not torch.equal(a, b) for a, b in zip(before[0], ours)),
                            any(not torch.equal(a, b) for a, b in zip(before[1], _state(fast))))
    return {"agree": agree, "skipped": fast.skipped_steps, "slow_skipped": slow.skipped_steps,
            "moved_at_bad": moved_at_bad}


def _train_all(rank, world):
    return {name: _train_both(rank, world, name) for name in BUILDS}


@pytest.fixture(scope="module")
def trained():
    """Every build's run, both ranks, from one pair of worker processes."""
    return run_workers(_train_all, 2)


@pytest.mark.parametrize("name", list(BUILDS))
def test_each_step_lands_bit_for_bit_as_the_host_read_skip_and_the_bad_one_moves_nothing(trained, name):
    for rank, runs in enumerate(trained):
        r = runs[name]
        assert all(p and s for p, s in r["agree"]), (rank, r["agree"])
        assert r["skipped"] == r["slow_skipped"] == [BAD_STEP + 1]      # steps count from 1
        assert r["moved_at_bad"] == (False, False)


def _malformed(rank, world):
    params = _params()
    opt = thinwire.EF21Muon(params, lr=0.02, nonfinite="skip")
    encode = opt._encode

    def corrupt(step, layout, exchange):
        encode(step, layout, exchange)
        if step == 2 and rank == 1:
            exchange.payload.fill_(0xFF)                # every uplink value a NaN, its indices out of range
    opt._encode = corrupt
    return _until_error(rank, opt, params)


def test_a_malformed_uplink_raises_on_every_rank_at_the_next_call_with_nothing_applied():
    """Rank 0 (the server) names the malformed payload; the worker learns that rank 0 rejected
    the step; both one call later than 'raise' would, and step 2 moved nothing on either."""
    (out0, moved0), (out1, moved1) = run_workers(_malformed, 2)
    assert [o[0] for o in out0] == ["ok", "ok", "ValueError"], out0
    assert "malformed payload" in out0[2][1] and "step 2" in out0[2][1]
    assert [o[0] for o in out1] == ["ok", "ok", "PeerMismatchError"], out1
    assert "rank 0" in out1[2][1]
    assert moved0 == moved1 == [True, False, False]
