"""nonfinite='skip' without a host read (`thinwire.optim.verdict`): a step applied under the
device's verdict lands exactly as the host-read skip does, the skip is reported at the next
call, and ranks out of lockstep or a malformed payload raise on every rank one call later
with nothing applied. Real gloo processes, world 2."""

import pytest
import torch

import thinwire
from thinwire.compress import Payload

from ..dist import outcome_of, run_workers

SHAPES = [(64, 64), (128, 64), (64,), (32, 64)]        # chunk 32: every one joins a group
BAD_STEP, STEPS = 3, 6


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _host_path(opt):
    """The same optimizer reading the verdict on the host and landing the step there (the
    path every algorithm has)."""
    opt._applies_masked = lambda layout: False
    if isinstance(opt, (thinwire.DiLoCo, thinwire.SparseLoCo)):   # its device path is the local step's too
        opt._masks_nonfinite = lambda layout: False
    return opt


BUILDS = {
    "demo": lambda ps: thinwire.DeMo(ps, lr=0.01, topk=8, chunk=32, weight_decay=0.1, nonfinite="skip"),
    "demo-overlap": lambda ps: thinwire.DeMo(ps, lr=0.01, topk=8, chunk=32, nonfinite="skip", overlap=True,
                                             lookahead="momentum"),
    "dense-fused": lambda ps: thinwire.DenseAllReduce(torch.optim.AdamW(ps, lr=0.01, fused=True), nonfinite="skip"),
    # the bad gradient at a local step (syncs at 3 and 6), which the bad rank alone skips
    "diloco-fused": lambda ps: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=0.01, fused=True),
                                               sync_every=3, nonfinite="skip"),
    # the bad gradient at a sync (every 2nd step), whose landing is masked on the device
    "diloco-sync-fused": lambda ps: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=0.01, fused=True),
                                                    sync_every=2, nonfinite="skip"),
    "sparseloco-fused": lambda ps: thinwire.SparseLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=0.01, fused=True),
                                                       sync_every=3, topk=16, chunk=32, nonfinite="skip"),
}


LOCAL = ("diloco-fused", "sparseloco-fused")              # the bad gradient falls on a local step
ALONE = (*LOCAL, "diloco-sync-fused")       # the healthy ranks make their local step: only the bad rank stays


def _state(opt) -> list[torch.Tensor]:
    return [t.clone() for p in opt.params for t in opt.state[p].values() if torch.is_tensor(t)]


def _train_both(rank, world, name):
    """The device-verdict optimizer and its host-path twin side by side on the same gradients
    (NaN on rank 1 at BAD_STEP): per step, whether parameters and state agree bit for bit."""
    ours, theirs = _params(), _params()
    fast, slow = BUILDS[name](ours), _host_path(BUILDS[name](theirs))
    local = name in LOCAL
    assert fast._masks_nonfinite(fast.layout()) and (local or fast._applies_masked(fast.layout()))
    gen, agree, before_bad = torch.Generator().manual_seed(rank), [], None
    for step in range(STEPS):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen)
            if step == BAD_STEP and rank == 1:
                a.grad[0] = float("nan")
            b.grad = a.grad.clone()
        if step == BAD_STEP:
            before_bad = [p.detach().clone() for p in ours], _state(fast)
        fast.step()
        slow.step()
        same_params = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        same_state = all(torch.equal(a, b) for a, b in zip(_state(fast), _state(slow)))
        agree.append((same_params, same_state))
        if step == BAD_STEP:
            after_bad = [p.detach().clone() for p in ours], _state(fast)
    fast.flush()
    slow.flush()
    return {"agree": agree, "skipped": fast.skipped_steps, "slow_skipped": slow.skipped_steps,
            "before": before_bad, "after": after_bad, "params": [p.detach() for p in ours]}


@pytest.fixture(scope="module", params=list(BUILDS))
def both(request):
    return request.param, run_workers(_train_both, 2, args=(request.param,))


def test_the_device_verdict_lands_every_step_as_the_host_read_does(both):
    name, ranks = both
    for rank, r in enumerate(ranks):
        for step, (same_params, same_state) in enumerate(r["agree"]):
            assert same_params and same_state, (rank, step)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))


def test_the_skipped_step_moves_no_parameter_and_is_reported(both):
    name, ranks = both
    for rank, r in enumerate(ranks):
        assert r["skipped"] == r["slow_skipped"] == ([] if name in LOCAL else [BAD_STEP + 1])   # steps count from 1
        if not name.endswith("overlap") and (rank == 1 or name not in ALONE):   # overlap lands it a call later
            assert all(torch.equal(a, b) for a, b in zip(r["before"][0], r["after"][0]))


@pytest.mark.parametrize("both", [n for n in BUILDS if n != "demo-overlap"], indirect=True)  # it lands a call later
def test_a_bad_rank_keeps_what_it_would_keep_without_a_gradient(both):
    """DeMo's bad rank takes its NaN gradients as zeros (M ← βM + 0, its top-k sent, then
    given back when the step is skipped: βM to rounding); AdamW's and DiLoCo's state do not move."""
    name, ranks = both
    before, after = ranks[1]["before"][1], ranks[1]["after"][1]
    decay = 0.999 if name == "demo" else 1.0              # the others' bad rank skips its update
    for m0, m1 in zip(before, after):
        torch.testing.assert_close(m1, decay * m0, rtol=1e-6, atol=1e-7)


def _until_error(rank: int, opt, params, before_call=None) -> tuple[list, list[bool]]:
    """Calls of opt.step() on fresh gradients until one raises (at most 5): each call's
    outcome and whether it moved a parameter; `before_call(call)` runs before each."""
    gen, outcomes, moved = torch.Generator().manual_seed(rank), [], []
    for call in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if before_call is not None:
            before_call(call)
        before = [p.detach().clone() for p in params]
        outcomes.append(outcome_of(opt.step))
        moved.append(any(not torch.equal(p, b) for p, b in zip(params, before)))
        if outcomes[-1][0] != "ok":
            break
    return outcomes, moved


def _out_of_lockstep(rank, world):
    params = _params()
    opt = thinwire.DeMo(params, lr=0.01, topk=8, chunk=32, nonfinite="skip")

    def resumed_elsewhere(call):
        if call == 2 and rank == 1:
            opt._step += 7                                   # as if resumed from another checkpoint
    return _until_error(rank, opt, params, resumed_elsewhere)


def test_ranks_out_of_lockstep_raise_on_every_rank_at_the_next_call_with_nothing_applied():
    for outcomes, moved in run_workers(_out_of_lockstep, 2):
        assert [o[0] for o in outcomes] == ["ok", "ok", "ok", "PeerMismatchError"], outcomes
        assert "lockstep" in outcomes[3][1]
        assert moved == [True, True, False, False]


def _malformed(rank, world):
    params = _params()
    opt = thinwire.DeMo(params, lr=0.01, topk=8, chunk=32, nonfinite="skip")
    encode = opt._encode

    def corrupt(step, layout, exchange):
        encode(step, layout, exchange)
        if step == 2 and rank == 0:
            comp = opt.compressor(opt.param_groups[0])
            part = Payload.from_buffer(exchange.payload[: comp.payload_nbytes(SHAPES[0])],
                                       comp.payload_spec(SHAPES[0])).parts
            part["values"][:2].fill_(0xFF)                   # a bf16 NaN
    opt._encode = corrupt
    return _until_error(rank, opt, params)


def test_a_malformed_payload_raises_on_every_rank_at_the_next_call_with_nothing_applied():
    for outcomes, moved in run_workers(_malformed, 2):
        assert [o[0] for o in outcomes] == ["ok", "ok", "ValueError"], outcomes
        assert "malformed payload" in outcomes[2][1] and "step 2" in outcomes[2][1]
        assert moved == [True, False, False]


def _diloco_raise(rank, world):
    params = _params()
    opt = thinwire.DiLoCo(params, inner=lambda q: torch.optim.AdamW(q, lr=0.01, fused=True), sync_every=3)
    gen, outcomes = torch.Generator().manual_seed(rank), []
    for step in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
            if step == 0 and rank == 1:
                p.grad[0] = float("inf")
        outcomes.append(outcome_of(opt.step)[0])
    return outcomes, [p.detach() for p in params]


def test_a_bad_local_step_is_carried_on_the_device_to_the_sync_where_every_rank_raises():
    """nonfinite='raise' with a fused inner optimizer: the local step reads nothing, its flag
    travels in the next sync's message, and every rank raises there; the next sync is made."""
    (first, params0), (second, params1) = run_workers(_diloco_raise, 2)
    assert first == second == ["ok", "ok", "NonFiniteGradientError", "ok", "ok", "ok"]
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
