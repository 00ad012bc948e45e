"""SparseLoCo through thinwire.optim.elastic.remap, as test_elastic.py checks the others: 4 gloo
ranks train and save, 2 ranks remap, load and train on, 3 ranks remap those and finish.
Each new rank's state is checked element for element against the policy, computed here from
the old ranks' states: e ('error') and the inner AdamW's moments mixed by the interval rule,
θ₀ ('anchor') and AdamW's step count kept; with a sync in flight (overlap=True) the sync is
dropped, so e is the one the last landed sync left."""

from __future__ import annotations

import copy

import pytest
import torch

import thinwire
from thinwire.optim.checkpoints import INFLIGHT_KEY, STEP_KEY
from thinwire.optim.elastic import mix, mixing_weights, remap
from tests.dist import run_workers
from tests.optim import problem
from tests.optim.test_elastic import _eq, _mixed, _train      # the interval rule written out, exact equality

MID, END = 12, 16                   # steps after the 2-rank and the 3-rank legs (a sync every 4)
HAND = {(4, 2): [[.5, .5, 0, 0], [0, 0, .5, .5]], (2, 3): [[1, 0], [.5, .5], [0, 1]]}


def _build(**kw):
    return lambda ps: thinwire.SparseLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-2), sync_every=4, topk=64,
                                          chunk=16, **kw)


CASES = {"sparseloco": (_build(), 7),
         "sparseloco-overlap": (_build(overlap=True), 8),                   # the sync of step 8 in flight
         "sparseloco-delayed": (_build(overlap=True, delay=4, eager=False), 10)}   # that of step 8, 2 local steps since
EAGER = (_build(overlap=True, delay=4), 10)                                 # the same, the replicas jumped: refused


def _old_run(rank: int, world: int) -> dict:
    out = {}
    for name, (build, steps) in CASES.items():
        model = problem.make_model()
        opt = build(list(model.parameters()))
        _train(model, opt, rank, steps)
        out[name] = (opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
    model = problem.make_model()
    opt = EAGER[0](list(model.parameters()))
    _train(model, opt, rank, EAGER[1])
    out["eager"] = opt.state_dict()
    return out


def _new_run(rank: int, world: int, olds: list[dict], target: int) -> dict:
    out = {}
    row = mixing_weights(len(olds), world)[rank]
    if "eager" in olds[0]:
        try:
            remap(EAGER[0](list(problem.make_model().parameters())), [old["eager"] for old in olds], rank)
        except ValueError as err:
            out["eager_refused"] = str(err)
    for name, (build, _) in CASES.items():
        models = [old[name][1] for old in olds]
        model = problem.make_model()
        model.load_state_dict({k: mix([m[k] for m in models], row, k) for k in models[0]})   # drifting replicas
        opt = build(list(model.parameters()))
        state = remap(opt, [old[name][0] for old in olds], rank)
        remapped = copy.deepcopy(state)
        opt.load_state_dict(state)
        start = problem.eval_loss(model)
        _train(model, opt, rank, target - opt.steps_done)
        saved = (opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
        opt.flush()
        out[name] = {"remapped": remapped, "saved": saved, "final": problem.flat_params(model),
                     "loss": (start, problem.eval_loss(model))}
    return out


@pytest.fixture(scope="module")
def runs():
    old = run_workers(_old_run, 4)
    mid = run_workers(_new_run, 2, args=(old, MID))
    end = run_workers(_new_run, 3, args=([{n: r[n]["saved"] for n in CASES} for r in mid], END))
    return old, mid, end


def _check(olds: list[dict], new: dict, a_row: list) -> None:
    first = olds[0]
    assert new[STEP_KEY] == first[STEP_KEY] and INFLIGHT_KEY not in new      # a sync in flight: dropped
    for pid, s in first["inner"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):                                # per rank
            _eq(new["inner"]["state"][pid][key], _mixed([o["inner"]["state"][pid][key] for o in olds], a_row))
        _eq(new["inner"]["state"][pid]["step"], s["step"])                   # equal on every rank: kept
    for n, s in enumerate(first["outer"]):
        _eq(new["outer"][n]["anchor"], s["anchor"])                          # replicated: kept
        # e per rank: the committed one (an in-flight sync's e' never was)
        _eq(new["outer"][n]["error"], _mixed([o["outer"][n]["error"] for o in olds], a_row))
        assert set(new["outer"][n]) == {"anchor", "error"}


@pytest.mark.parametrize("name", list(CASES))
def test_remapped_state_follows_the_policy_4_to_2_and_2_to_3(runs, name):
    old, mid, end = runs
    olds = [o[name][0] for o in old]
    assert all(o["outer"][0]["error"].abs().sum() > 0 for o in olds)         # a real residual, per rank
    assert not torch.equal(olds[0]["outer"][0]["error"], olds[1]["outer"][0]["error"])
    assert (INFLIGHT_KEY in olds[0]) == (name != "sparseloco")
    for j, leg in enumerate(mid):
        _check(olds, leg[name]["remapped"], HAND[(4, 2)][j])
    for j, leg in enumerate(end):
        _check([m[name]["saved"][0] for m in mid], leg[name]["remapped"], HAND[(2, 3)][j])


@pytest.mark.parametrize("name", list(CASES))
def test_training_goes_on_with_identical_replicas(runs, name):
    """Both legs end on a sync (flush() lands an overlapped one): replicas bit-identical. The
    loss is compared with the untrained model's, not the leg's start: a leg starts from the
    mixed replicas, which hold all their local progress, and ends on θ₀, which the sparse
    syncs have moved by the sent part only (the rest waits in e); with the dropped sync in
    flight that start is 8 local steps ahead of θ₀."""
    _, mid, end = runs
    untrained = problem.eval_loss(problem.make_model())
    for leg in (mid, end):
        for r in leg[1:]:
            _eq(r[name]["final"], leg[0][name]["final"])
        for r in leg:
            assert r[name]["loss"][1] < 0.5 * untrained, (r[name]["loss"], untrained)


def test_an_eager_jump_in_flight_is_refused_naming_the_way_out(runs):
    _, mid, _ = runs
    for leg in mid:
        assert "after an eager jump" in leg["eager_refused"] and "flush() before the checkpoint" in leg["eager_refused"]
