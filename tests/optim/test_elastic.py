"""Elastic resume (thinwire.optim.elastic): the interval rule's weights against hand-derived
matrices; each optimizer's remapped state checked element for element against the documented
policy, computed here from the old ranks' states; real round trips 4 -> 2 -> 3 ranks.

Three worker launches serve every case: 4 gloo ranks train OLD steps and save their states
(some with a step in flight); 2 ranks remap them, load, train to step MID and save; 3 ranks
remap those and train to step END. The parent checks the remapped states (each new rank
returns its own) and that replicas agree and the loss falls on the new world.
"""

from __future__ import annotations

import copy

import pytest
import torch

import thinwire
from thinwire.comm.collectives import padded_numel
from thinwire.compress import ChunkedTopK
from thinwire.optim.checkpoints import INFLIGHT_KEY, STATS_KEY, STEP_KEY
from thinwire.optim.elastic import mix, mixing_weights, remap
from tests.dist import run_workers
from tests.optim import problem

MID, END = 12, 16           # step counts after the 2-rank and the 3-rank legs (syncs: every 4)
NUMEL = 24 * 37 + 37 + 37 * 10 + 10
DEMO = dict(lr=0.01, topk=8, chunk=16)
HAND = {(4, 2): [[.5, .5, 0, 0], [0, 0, .5, .5]],                   # A[j, i] = W' |I'_j ∩ I_i|
        (2, 4): [[1, 0], [1, 0], [0, 1], [0, 1]],
        (3, 2): [[2 / 3, 1 / 3, 0], [0, 1 / 3, 2 / 3]],
        (2, 3): [[1, 0], [.5, .5], [0, 1]]}


def _adamw(q):
    return torch.optim.AdamW(q, lr=1e-2)


# name: (build, old steps, drifting replicas). DiLoCo's outer momentum is 0.3, not the published
# 0.9: at 4 local steps on this tiny problem 0.9 overshoots at every sync (the loss after the
# sync at step 12 is 4x the one at step 7 in an uninterrupted 4-rank run), 0.3 descends.
CASES = {
    "demo": (lambda ps: thinwire.DeMo(ps, **DEMO), 7, False),
    "demo-overlap": (lambda ps: thinwire.DeMo(ps, **DEMO, momentum_domain="param", overlap=True), 7, False),
    "apm-compressed": (lambda ps: thinwire.APMSqueeze(ps, lr=1e-2, warmup_steps=5), 7, False),
    "apm-warmup": (lambda ps: thinwire.APMSqueeze(ps, lr=1e-2, warmup_steps=1000), 7, False),
    "ef21": (lambda ps: thinwire.EF21Muon(ps, lr=0.02, beta=0.3, uplink="topk:0.3"), 7, False),
    "ef21-overlap": (lambda ps: thinwire.EF21Muon(ps, lr=0.02, beta=0.3, uplink="topk:0.3", topology="replicated",
                                                  overlap=True), 7, False),
    "lordo": (lambda ps: thinwire.LoRDO(ps, lr=1e-2, rank=4, sync_every=4), 7, True),
    "diloco": (lambda ps: thinwire.DiLoCo(ps, inner=_adamw, sync_every=4, outer_lr=0.7, outer_momentum=0.3), 7, True),
    "diloco-overlap": (lambda ps: thinwire.DiLoCo(ps, inner=_adamw, sync_every=4, outer_lr=0.7, outer_momentum=0.3,
                                                   overlap=True), 8,
                       True),
    "dense": (lambda ps: thinwire.DenseAllReduce(_adamw(ps)), 7, False),
    "dense-overlap": (lambda ps: thinwire.DenseAllReduce(_adamw(ps), overlap=True), 7, False),
    "apm-warmup-overlap": (lambda ps: thinwire.APMSqueeze(ps, lr=1e-2, warmup_steps=1000, overlap=True), 7, False),
    "apm-overlap": (lambda ps: thinwire.APMSqueeze(ps, lr=1e-2, warmup_steps=5, overlap=True), 7, False),
    "demo-lookahead": (lambda ps: thinwire.DeMo(ps, **DEMO, overlap=True, lookahead="momentum"), 7, False),
    "sign-demo": (lambda ps: thinwire.SignDeMo(ps, lr=0.01, topk=8, chunk=16), 7, False),    # declares momentum per rank
}
REFUSED = ("apm-overlap", "demo-lookahead")


def _train(model, opt, rank: int, calls: int) -> list[torch.Tensor]:
    """`calls` steps on this rank's batches; the parameters after each."""
    seen = []
    for _ in range(calls):
        problem.loss_on(model, *problem.batch(rank, opt.steps_done)).backward()
        opt.step()
        opt.zero_grad()
        seen.append(problem.flat_params(model))
    return seen


def _old_run(rank: int, world: int) -> dict:
    out = {}
    for name, (build, steps, _) in CASES.items():
        model = problem.make_model()
        opt = build(list(model.parameters()))
        _train(model, opt, rank, steps)
        out[name] = (opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
    return out


def _new_run(rank: int, world: int, olds: list[dict], target: int) -> dict:
    """Remap every case's old states for this rank, load, train to step `target`."""
    out = {}
    row = mixing_weights(len(olds), world)[rank]
    for name in olds[0]:
        build, _, drifting = CASES[name]
        models = [old[name][1] for old in olds]
        model = problem.make_model()
        model.load_state_dict({k: mix([m[k] for m in models], row, k) for k in models[0]} if drifting else models[0])
        opt = build(list(model.parameters()))
        try:
            state = remap(opt, [old[name][0] for old in olds], rank)
        except ValueError as err:
            out[name] = {"refused": str(err)}
            continue
        remapped = copy.deepcopy(state)                  # torch's load keeps these tensors, training moves them
        opt.load_state_dict(state)
        start = problem.eval_loss(model)
        seen = _train(model, opt, rank, target - opt.steps_done)
        saved = (opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
        opt.flush()
        out[name] = {"remapped": remapped, "seen": seen, "final": problem.flat_params(model), "saved": saved,
                     "loss": (start, problem.eval_loss(model))}
    return out


@pytest.fixture(scope="module")
def runs():
    old = run_workers(_old_run, 4)
    mid = run_workers(_new_run, 2, args=(old, MID))
    end = run_workers(_new_run, 3, args=([{n: r[n]["saved"] for n in r if "saved" in r[n]} for r in mid], END))
    return old, mid, end


# ---- the weights -------------------------------------------------------------------------
@pytest.mark.parametrize("old,new", sorted(HAND))
def test_mixing_weights_match_hand_derived_matrices(old, new):
    assert torch.allclose(mixing_weights(old, new), torch.tensor(HAND[(old, new)], dtype=torch.float64),
                          rtol=0, atol=1e-15)


def test_mixing_weights_identity_rows_and_columns():
    for w in range(1, 6):
        assert torch.equal(mixing_weights(w, w), torch.eye(w, dtype=torch.float64))
    for old in range(1, 8):
        for new in range(1, 8):
            a = mixing_weights(old, new)
            assert a.shape == (new, old) and a.dtype == torch.float64 and bool((a >= 0).all())
            assert torch.allclose(a.sum(1), torch.ones(new, dtype=torch.float64), atol=1e-12)   # convex rows
            assert torch.allclose(a.sum(0), torch.full((old,), new / old, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("old,new", [(0, 2), (2, 0), (2.0, 1), (True, 2)])
def test_mixing_weights_reject_bad_world_sizes(old, new):
    with pytest.raises(ValueError, match="old_world|new_world"):
        mixing_weights(old, new)


# ---- each optimizer's remapped state, against the documented rule --------------------------
def _mixed(values: list, a_row: list):
    """Σ_i A[j, i] X_i, in float64, cast back: the interval rule written out here."""
    return sum(w * v.double() for v, w in zip(values, a_row) if w).to(values[0].dtype)


def _eq(a, b) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


def _kept(new, old) -> None:
    """Replicated state: exactly the old ranks' value."""
    assert torch.equal(new, old) if torch.is_tensor(old) else new == old


def _padded(n: int, world: int) -> int:                   # a multiple of 8 W, at least 8 W
    return max(1, -(-n // (8 * world))) * 8 * world


def _demo_folded(old: dict) -> dict:
    """pid -> momentum with the in-flight message added back: M + T⁻¹(Q̂_i) (param domain, α = 1)."""
    momenta = {pid: s["momentum"] for pid, s in old["state"].items()}
    record = old.get(INFLIGHT_KEY)
    if record is None:
        return momenta
    comp, offset = ChunkedTopK(DEMO["topk"], DEMO["chunk"], "dct", "bf16", 0), 8 + 1     # prefix: 4 parameters
    payload = record["message"][0]
    for pid, m in momenta.items():
        n = comp.payload_nbytes(m.shape)
        momenta[pid] = m + comp.decode(payload[offset: offset + n], m.shape, record["step"])
        offset += n
    return momenta


def _check_state(name: str, olds: list[dict], new: dict, j: int) -> None:
    """New rank j's remapped state against the policy, from the old ranks' states."""
    first, new_world = olds[0], len(HAND[(len(olds), 2 if len(olds) == 4 else 3)])
    a_row = HAND[(len(olds), new_world)][j]
    assert new[STEP_KEY] == first[STEP_KEY]
    for field in ("payload_bytes", "link_bytes_sent"):       # per-rank history, mixed and rounded
        totals = [o[STATS_KEY]["totals"][field] for o in olds]
        assert new[STATS_KEY]["totals"][field] == round(sum(w * t for t, w in zip(totals, a_row) if w))
    summed = name in ("dense-overlap", "apm-warmup-overlap")
    assert (INFLIGHT_KEY in new) == (summed and INFLIGHT_KEY in first)
    if INFLIGHT_KEY in new:                          # the all-reduced sum, W'/W of it: the same mean over W'
        total = first[INFLIGHT_KEY]["message"][0]
        _eq(new[INFLIGHT_KEY]["message"][0], (total.double() * new_world / len(olds)).to(total.dtype))
        assert new[INFLIGHT_KEY]["step"] == first[INFLIGHT_KEY]["step"]
    if name in ("demo", "demo-overlap"):
        folded = [_demo_folded(o) for o in olds]
        for pid in first["state"]:
            expected = _mixed([f[pid] for f in folded], a_row)
            if INFLIGHT_KEY in first:     # T⁻¹ here is the public decode: its own float rounding (~1e-12)
                assert torch.allclose(new["state"][pid]["momentum"], expected, rtol=0, atol=1e-9)
            else:
                _eq(new["state"][pid]["momentum"], expected)
    elif name == "sign-demo":                           # its only state: each rank's momentum, mixed
        for pid in first["state"]:
            _eq(new["state"][pid]["momentum"], _mixed([o["state"][pid]["momentum"] for o in olds], a_row))
    elif name.startswith("apm"):
        errors, here = [o["apmsqueeze"] for o in olds], new["apmsqueeze"]
        assert (here["world_size"], here["rank"]) == (new_world, j)
        for pid, s in first["state"].items():
            for key, value in s.items():
                _kept(new["state"][pid][key], value)
        if name.startswith("apm-warmup"):
            assert here["worker_error"] is None and here["server_error"] is None
            return
        worker = here["worker_error"]
        _eq(worker[:NUMEL], _mixed([e["worker_error"][:NUMEL] for e in errors], a_row))
        assert not worker[NUMEL:].any()
        cut = torch.cat([e["server_error"] for e in errors])[:NUMEL]     # rank order, the padding dropped
        whole = torch.cat([cut, torch.zeros(_padded(NUMEL, new_world) - NUMEL)])
        size = here["server_error"].numel()
        _eq(here["server_error"], whole[j * size: (j + 1) * size])
    elif name.startswith("ef21"):
        momenta = [o["state"] if INFLIGHT_KEY not in o else
                   {pid: {"momentum": m} for pid, m in enumerate(o[INFLIGHT_KEY]["algorithm"]["momenta"])}
                   for o in olds]
        for pid, s in first["state"].items():
            _eq(new["state"][pid]["momentum"], _mixed([m[pid]["momentum"] for m in momenta], a_row))
            _eq(new["state"][pid]["estimate"], _mixed([o["state"][pid]["estimate"] for o in olds], a_row))
            server = name == "ef21-overlap" or j == 0                # topology 'replicated': every rank
            for key in ("server_estimate", "server_model"):
                assert (key in new["state"][pid]) == server
                if server:
                    _eq(new["state"][pid][key], s[key])
    elif name in ("lordo", "diloco", "diloco-overlap"):
        lordo = name == "lordo"                                 # DiLoCo: the inner AdamW's state
        inner = [o["state"] if lordo else o["inner"]["state"] for o in olds]
        mapped = new["state"] if lordo else new["inner"]["state"]
        for pid, s in inner[0].items():
            for key in ("exp_avg", "exp_avg_sq", "error"):      # per rank
                if key in s:
                    _eq(mapped[pid][key], _mixed([st[pid][key] for st in inner], a_row))
            for key in ("Q", "anchor", "step"):                 # replicated (and equal step counts)
                if key in s:
                    _kept(mapped[pid][key], s[key])
        for s, n in zip(first.get("outer", []), new.get("outer", [])):
            _eq(n["anchor"], s["anchor"])
    elif name.startswith("dense"):
        for pid, s in first["optimizers"][0]["state"].items():
            for key, value in s.items():
                _eq(new["optimizers"][0]["state"][pid][key], value)


CHECKED = [n for n in CASES if n not in REFUSED]


@pytest.mark.parametrize("name", CHECKED)
def test_remapped_state_follows_the_policy_4_to_2_and_2_to_3(runs, name):
    old, mid, end = runs
    for j, leg in enumerate(mid):
        _check_state(name, [o[name][0] for o in old], leg[name]["remapped"], j)
    for j, leg in enumerate(end):
        _check_state(name, [m[name]["saved"][0] for m in mid], leg[name]["remapped"], j)


@pytest.mark.parametrize("name", ["ef21", "ef21-overlap"])
def test_ef21_server_estimate_is_still_the_mean_of_the_workers(runs, name):
    """G = (1/n) Σ_j G_j before and after: the interval rule preserves the mean over ranks."""
    old, mid, _ = runs
    for states in ([o[name][0] for o in old], [m[name]["remapped"] for m in mid]):
        for pid, s in old[0][name][0]["state"].items():
            mean = torch.stack([st["state"][pid]["estimate"] for st in states]).double().mean(0)
            assert torch.allclose(mean, s["server_estimate"].double(), atol=1e-6)


@pytest.mark.parametrize("name", CHECKED)
def test_training_goes_on_with_identical_replicas_after_2_and_3_ranks(runs, name):
    _, mid, end = runs
    drifting = CASES[name][2]
    for leg in (mid, end):
        results = [r[name] for r in leg]
        if not drifting:                                  # every step lands the same update everywhere
            for step in range(len(results[0]["seen"])):
                for r in results[1:]:
                    _eq(r["seen"][step], results[0]["seen"][step])
        for r in results[1:]:                             # drifting ones: after the last sync
            _eq(r["final"], results[0]["final"])
        for r in results:
            start, stop = r["loss"]
            assert torch.isfinite(torch.tensor([start, stop])).all() and stop < start, (start, stop)


@pytest.mark.parametrize("name", REFUSED)
def test_a_step_in_flight_without_local_state_is_refused(runs, name):
    _, mid, _ = runs
    for r in mid:
        assert "in flight" in r[name]["refused"] and "flush()" in r[name]["refused"]


# ---- bad input (one process: W' = 1) ------------------------------------------------------
def _states(runs, name) -> list[dict]:
    return [o[name][0] for o in runs[0]]


def test_four_ranks_onto_one_average_all_four(runs):
    opt = CASES["demo"][0](list(problem.make_model().parameters()))
    state = remap(opt, _states(runs, "demo"), 0)
    for pid in state["state"]:
        _eq(state["state"][pid]["momentum"], _mixed([s["state"][pid]["momentum"] for s in _states(runs, "demo")],
                                                    [.25] * 4))
    opt.load_state_dict(state)


def test_the_same_world_size_resumes_bit_for_bit_a_step_in_flight_included():
    """W' = W: this rank's own state as saved; the run goes on as if never interrupted."""
    def run(split: bool) -> torch.Tensor:
        model = problem.make_model()
        opt = CASES["demo-overlap"][0](list(model.parameters()))
        _train(model, opt, 0, 5)
        if split:
            saved = copy.deepcopy(opt.state_dict())
            assert INFLIGHT_KEY in saved
            opt = CASES["demo-overlap"][0](list(model.parameters()))
            state = remap(opt, [saved], 0)
            assert state.keys() == saved.keys() and torch.equal(state[INFLIGHT_KEY]["message"][0],
                                                               saved[INFLIGHT_KEY]["message"][0])
            opt.load_state_dict(state)
        _train(model, opt, 0, 5)
        opt.flush()
        return problem.flat_params(model)
    _eq(run(True), run(False))


def test_another_optimizer_is_refused_naming_what_differs(runs):
    opt = CASES["ef21"][0](list(problem.make_model().parameters()))
    with pytest.raises(ValueError, match="param group 0 differs in .*lmo"):
        remap(opt, _states(runs, "demo"), 0)
    dense = CASES["dense"][0](list(problem.make_model().parameters()))
    with pytest.raises(ValueError, match="lacks \\['optimizers'\\]"):
        remap(dense, _states(runs, "demo"), 0)


def test_other_shapes_and_hyperparameters_are_refused(runs):
    torch.manual_seed(0)
    wider = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 10))
    with pytest.raises(ValueError, match="shape"):
        remap(thinwire.DeMo(list(wider.parameters()), **DEMO), _states(runs, "demo"), 0)
    other = thinwire.DeMo(list(problem.make_model().parameters()), **{**DEMO, "topk": 4})
    with pytest.raises(ValueError, match="differs in topk"):
        remap(other, _states(runs, "demo"), 0)
    apm = thinwire.APMSqueeze(list(problem.make_model().parameters()), lr=1e-2, warmup_steps=6)
    with pytest.raises(ValueError, match="warmup_steps"):
        remap(apm, _states(runs, "apm-compressed"), 0)


def test_disagreeing_old_ranks_and_bad_arguments_are_refused(runs):
    opt = CASES["dense"][0](list(problem.make_model().parameters()))
    states = _states(runs, "dense")
    broken = {**states[1], "optimizers": [{**states[1]["optimizers"][0], "state": {
        pid: {**s, "exp_avg": s["exp_avg"] + 1} for pid, s in states[1]["optimizers"][0]["state"].items()}}]}
    with pytest.raises(ValueError, match="differs between old rank 0 and old rank 1"):
        remap(opt, [states[0], broken, *states[2:]], 0)
    with pytest.raises(ValueError, match="step count"):
        remap(opt, [states[0], {**states[1], STEP_KEY: 3}, *states[2:]], 0)
    with pytest.raises(ValueError, match="rank must be"):
        remap(opt, states, 1)
    with pytest.raises(ValueError, match="states must be"):
        remap(opt, [], 0)
