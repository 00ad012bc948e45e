"""overlap=True is the same algorithm with each exchange applied one call later, checked on
2 gloo ranks against that reference built by hand from the optimizer without overlap.

With overlap, call t finishes step t − 1's exchange and then starts step t, so the state
advances exactly as without overlap (start t − 1, finish t − 1, start t, ...); what differs
is where the caller's gradient is taken: at the parameters as start_step() of the previous
call left them, before its exchange was applied. The reference runs the optimizer without
overlap through start_step()/finish_step(), takes each gradient at a copy of the parameters
made between the two calls of the previous step, and must agree bit for bit. For optimizers
exchanging every step that is the gradient at the parameters of two calls before; for
LoRDO and DiLoCo, whose local steps are not delayed, only the gradient after a sync is taken
at the pre-sync parameters.

DeMo's lookahead takes each gradient where the rank's own estimate of the update in flight
moves the parameters. With one rank, lookahead='message' estimates with the whole aggregate,
so it is exact and the run must be DeMo without overlap, bit for bit, learning-rate schedule
and weight decay included; so must lookahead='momentum' when top-k keeps every coefficient
(fp32 values: the sent part is then the whole momentum, nothing stays behind).
"""

from __future__ import annotations

import copy

import pytest
import torch

import thinwire
from thinwire.optim.protocol import PeerMismatchError
from tests.dist import run_workers
from tests.optim import problem
from tests.optim.registry import REGISTRY

STEPS = 10
PAIRS = {name: name.removesuffix("-overlap") for name in REGISTRY if name.endswith("-overlap")}


def _drop_on_odd_steps(model, step: int, drop: bool) -> None:
    """A parameter with a gradient on no rank every other step (it must then not move)."""
    if drop and step % 2:
        model[2].bias.grad = None


def _overlapped(name: str, rank: int, drop: bool = False, steps: int = STEPS) -> torch.Tensor:
    model = problem.make_model()
    opt = REGISTRY[name].build(list(model.parameters()))
    for step in range(steps):
        problem.loss_on(model, *problem.batch(rank, step)).backward()
        _drop_on_odd_steps(model, step, drop)
        opt.step()
        opt.zero_grad()
    opt.flush()
    return problem.flat_params(model)


def _late_gradient_reference(name: str, rank: int, drop: bool = False) -> torch.Tensor:
    model = problem.make_model()
    opt = REGISTRY[PAIRS[name]].build(list(model.parameters()))
    seen = copy.deepcopy(model)                  # the parameters the overlapped caller sees
    for step in range(STEPS):
        seen.zero_grad()
        problem.loss_on(seen, *problem.batch(rank, step)).backward()
        for p, q in zip(model.parameters(), seen.parameters()):
            p.grad = q.grad.clone()
        _drop_on_odd_steps(model, step, drop)
        opt.start_step()
        seen = copy.deepcopy(model)              # this step started, its exchange not yet applied
        opt.finish_step()
        opt.zero_grad()
    return problem.flat_params(model)


def _mismatch_then_flush(name: str, rank: int, steps: int) -> tuple[str, torch.Tensor]:
    """`steps` steps, then one whose wire settings change differently on each rank (the
    handshake refuses it: PeerMismatchError), then flush()."""
    model = problem.make_model()
    opt = REGISTRY[name].build(list(model.parameters()))
    topk, raised = opt.param_groups[0]["topk"], "nothing"
    for step in range(steps + 1):
        problem.loss_on(model, *problem.batch(rank, step)).backward()
        if step == steps:
            opt.param_groups[0]["topk"] += 1 + rank
        try:
            opt.step()
        except PeerMismatchError:
            raised = "PeerMismatchError"
        opt.zero_grad()
    opt.param_groups[0]["topk"] = topk
    opt.flush()
    return raised, problem.flat_params(model)


# A checkpoint taken with an exchange in flight, for the exchanges the registry's overlap
# entries do not cover: EF21-Muon's ServerRelay (gather, server step, broadcast; a lossy
# uplink) and a lossy periodic sync (its new error e' is kept aside until the sync lands).
IN_FLIGHT = {
    "ef21-muon server topk+int8": lambda ps: thinwire.EF21Muon(ps, lr=0.02, beta=0.3, uplink="topk:0.44+int8",
                                                               overlap=True),
    "diloco int8": lambda ps: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-2), sync_every=3,
                                              wire="int8", overlap=True),
}
CHECKPOINT_AT = 6            # calls: DiLoCo's sync of step 6 is then in flight


def _steps(model, opt, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        problem.loss_on(model, *problem.batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()


def _checkpointed(build, rank: int) -> tuple:
    """Parameters after STEPS calls and flush(): undisturbed, with a state_dict() after
    CHECKPOINT_AT calls, and resumed from that state_dict in fresh objects."""
    plain = problem.make_model()
    plain_opt = build(list(plain.parameters()))
    _steps(plain, plain_opt, rank, 0, STEPS)
    plain_opt.flush()
    model = problem.make_model()
    opt = build(list(model.parameters()))
    _steps(model, opt, rank, 0, CHECKPOINT_AT)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    _steps(model, opt, rank, CHECKPOINT_AT, STEPS)
    opt.flush()
    fresh = problem.make_model(seed=77)
    fresh.load_state_dict(saved["model"])
    fresh_opt = build(list(fresh.parameters()))
    fresh_opt.load_state_dict(saved["opt"])
    _steps(fresh, fresh_opt, rank, CHECKPOINT_AT, STEPS)
    fresh_opt.flush()
    return problem.flat_params(plain), problem.flat_params(model), problem.flat_params(fresh), "thinwire_in_flight" in saved["opt"]


def _both(rank: int, world: int) -> dict:
    runs = {name: (_overlapped(name, rank), _late_gradient_reference(name, rank)) for name in PAIRS}
    runs["in flight"] = {name: _checkpointed(build, rank) for name, build in IN_FLIGHT.items()}
    runs["demo-lookahead"] = (_overlapped("demo-lookahead", rank), _overlapped("demo-overlap", rank))
    runs["demo-overlap, bias without gradient on odd steps"] = (_overlapped("demo-overlap", rank, drop=True),
                                                                _late_gradient_reference("demo-overlap", rank, drop=True))
    runs["mismatch"] = (_mismatch_then_flush("demo-lookahead", rank, 3), _overlapped("demo-lookahead", rank, steps=3))
    return runs


@pytest.fixture(scope="module")
def runs():
    return run_workers(_both, 2, timeout=600)


@pytest.mark.parametrize("name", [*sorted(PAIRS), "demo-overlap, bias without gradient on odd steps"])
def test_overlap_is_the_algorithm_with_each_exchange_applied_a_call_later(runs, name):
    for per_rank in runs:
        overlapped, reference = per_rank[name]
        assert torch.equal(overlapped, reference)
        assert not torch.equal(overlapped, problem.flat_params(problem.make_model()))   # it trained


@pytest.mark.parametrize("name", sorted(IN_FLIGHT))
def test_a_checkpoint_with_an_exchange_in_flight_changes_nothing_and_resumes_exactly(runs, name):
    for per_rank in runs:
        plain, checkpointed, resumed, was_in_flight = per_rank["in flight"][name]
        assert was_in_flight
        assert torch.equal(checkpointed, plain)
        assert torch.equal(resumed, plain)
    if not name.startswith("diloco"):            # DiLoCo's replicas differ after its last local step
        assert torch.equal(runs[0]["in flight"][name][0], runs[1]["in flight"][name][0])


def test_lookahead_replicas_agree_after_flush_and_differ_from_plain_overlap(runs):
    (rank0, plain0), (rank1, _) = runs[0]["demo-lookahead"], runs[1]["demo-lookahead"]
    assert torch.equal(rank0, rank1)
    assert not torch.equal(rank0, plain0)


def test_a_peer_mismatch_leaves_the_exchange_in_flight_for_flush(runs):
    """DeMo starts its step before it lands the previous one: the step refused by the
    handshake must not take the previous step's exchange down with it."""
    for per_rank in runs:
        (raised, after_flush), reference = per_rank["mismatch"]
        assert raised == "PeerMismatchError"
        assert torch.equal(after_flush, reference)      # three steps, all applied
    assert torch.equal(runs[0]["mismatch"][0][1], runs[1]["mismatch"][0][1])


def _scheduled_run(base: str, steps: int = 8, **kw) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One process: DeMo with a decaying lr and weight decay; the gradients it was fed, and
    its parameters after flush()."""
    model = problem.make_model()
    opt = thinwire.DeMo(model.parameters(), lr=0.01, chunk=16, base=base, weight_decay=0.1, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    grads = []
    for step in range(steps):
        problem.loss_on(model, *problem.batch(0, step)).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.flush()
    return grads, problem.flat_params(model)


ONE_RANK_EXACT = [("message", dict(topk=8)), ("momentum", dict(topk=256, values="fp32")),
                  ("momentum", dict(topk=256, values="fp32", momentum_domain="param"))]


@pytest.mark.parametrize("base", ["signum", "sgd", "muon"])
@pytest.mark.parametrize("form, kw", ONE_RANK_EXACT)
def test_lookahead_with_one_rank_is_demo_without_overlap(base, form, kw):
    grads, params = _scheduled_run(base, overlap=True, lookahead=form, **kw)
    expected_grads, expected = _scheduled_run(base, **kw)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))
    assert torch.equal(params, expected)
    _, late = _scheduled_run(base, overlap=True, **kw)        # without the lookahead it is one step late
    assert not torch.equal(late, expected)


@pytest.mark.parametrize("kw, match", [(dict(lookahead="momentum"), "overlap=True"),
                                       (dict(overlap=True, lookahead=True), "lookahead must be one of")])
def test_lookahead_is_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        thinwire.DeMo([torch.nn.Parameter(torch.zeros(3))], **kw)


def test_overlap_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap"):
        REGISTRY["demo"].build([torch.nn.Parameter(torch.zeros(3))], overlap=1)
