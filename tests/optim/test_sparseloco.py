"""SparseLoCo on real gloo groups of 2 and 3 ranks (one spawn per world runs every check):

  * every sync against an independent reference written here from the paper's equations:
    R replicas with their own torch AdamW, Δ = θ₀ − θ, e = β e + Δ, top-k of every chunk by
    sorting, the 2-bit statistical quantizer in Python floats over each tensor's kept values,
    the mean in rank order, θ₀ ← θ₀ − α Δ̄; parameters and e bit for bit, on every rank;
  * replicas bit-identical after every sync, e different on every rank (a per-rank residual);
  * bytes per sync equal to the wire formula, derived by hand below; nothing between syncs;
  * β = 0, every element kept, fp32 values, α = 1: DiLoCo with outer_lr 1 and momentum 0
    (plain averaging), run in the same processes (bit for bit at 2 ranks, whose gloo sum is
    a + b too; to float rounding at 3, where gloo's ring sums in another order);
  * overlap=True is the delayed schedule: each gradient after a sync taken at the pre-sync
    parameters (built by hand from start_step / finish_step, as test_overlap.py does);
  * a state_dict mid-round (and one with a sync in flight, overlap=True) resumes bit for bit;
  * a NaN at a sync with nonfinite='skip': no rank moves its anchor or its e.
Bad arguments, and the parameters before an eager jump in a checkpoint, one process.
"""

from __future__ import annotations

import copy
import io
from fractions import Fraction

import pytest
import torch

from tests.optim import problem
from tests.optim.suite import on_world
from tests.wire.test_twobit import reference_row
from thinwire import DiLoCo, SparseLoCo
from thinwire.compress import ChunkPlan
from thinwire.optim.checkpoints import INFLIGHT_KEY
from thinwire.optim.dense_mean import DenseMean
from thinwire.optim.local_steps import LocalSteps
from thinwire.optim.sparseloco_sync import SparseTopKSync

H, STEPS, TOPK, CHUNK, BETA, ALPHA, LR = 3, 9, 32, 16, 0.9, 0.8, 1e-2
EAGER_SCALE = 1.5                                             # c of the eager jump, where a test sets it
SYNCS = [s for s in range(STEPS) if (s + 1) % H == 0]          # 0-based steps that end with a sync


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _sparseloco(params, **kw):
    settings = dict(inner=_adamw, sync_every=H, topk=TOPK, chunk=CHUNK, error_decay=BETA, outer_lr=ALPHA)
    return SparseLoCo(params, **{**settings, **kw})


# ---- the wire formula, by hand -------------------------------------------------------------
# problem.py's shapes with chunk 16 (thinwire.compress.chunking), as (chunks C, elements E):
#   (37, 24): 37 prime -> padded to 48, 3 row chunks of 16; 24 -> 12: 2 column chunks -> 6 x 192
#   (37,) -> (1, 37): padded to 48 -> 3 x 16;  (10, 37): 37 -> 48 -> 3 x (10 x 16 = 160);  (10,) -> 1 x 10
# k = round(E * 32 / 256) (half to even), at least 1: 24, 2, 20, round(1.25) = 1. Per tensor
# ceil(C k ceil(log2 E) / 8) index bytes, then 16 bytes of levels and ceil(C k / 4) of codes:
#   (37, 24): 144 + 16 + 36 = 196;  (37,): 3 + 16 + 2 = 21;  (10, 37): 60 + 16 + 15 = 91;  (10,): 1 + 16 + 1 = 18
# after the prefix: 8-byte header, 1 byte of presence for 4 parameters.
SYNC_BYTES = 9 + 196 + 21 + 91 + 18
# indices='elias-fano': L = floor(log2(E / k)) = 3 for all four (192/24, 16/2, 160/20, 10/1), a bitmap
# of B = k + floor((E - 1) / 8) + 1 bits per chunk: 48, 4, 40, 3. Index bytes ceil(C k 3 / 8) + ceil(C B / 8):
#   (37, 24): 54 + 36 = 90;  (37,): 3 + 2 = 5;  (10, 37): 23 + 15 = 38;  (10,): 1 + 1 = 2
EF_SYNC_BYTES = 9 + (90 + 16 + 36) + (5 + 16 + 2) + (38 + 16 + 15) + (2 + 16 + 1)


# ---- the independent reference ---------------------------------------------------------------
def quantize(values: list[float]) -> list[float]:
    """The paper's 2-bit statistical quantizer over one tensor's kept values, in Python floats
    (tests/wire/test_twobit.py's reference): 4 bins 6σ/4 wide around the mean, each value
    decoded as its bin's mean (float32)."""
    codes, levels = reference_row(values)
    return [levels[q] for q in codes]


def compress(x: torch.Tensor) -> torch.Tensor:
    """Q(TopK(x)) as a dense tensor: the k largest |x| of every chunk (by a stable sort), their
    values quantized together."""
    plan = ChunkPlan.for_shape(x.shape, CHUNK)
    padded = torch.zeros(plan.padded_rows, plan.padded_cols)
    padded[: plan.rows, : plan.cols] = x.reshape(plan.rows, plan.cols)
    h, w = plan.chunk_rows, plan.chunk_cols
    k = min(h * w, max(1, round(Fraction(h * w * TOPK, CHUNK ** 2))))
    kept = []                                                   # (row, col) in the padded matrix
    for a in range(plan.padded_rows // h):
        for b in range(plan.padded_cols // w):
            block = padded[a * h: (a + 1) * h, b * w: (b + 1) * w].reshape(-1)
            for i in torch.sort(block.abs(), descending=True, stable=True).indices[:k].tolist():
                kept.append((a * h + i // w, b * w + i % w))
    out = torch.zeros_like(padded)
    for (r, c), v in zip(kept, quantize([float(padded[r, c]) for r, c in kept])):
        out[r, c] = v
    return out[: plan.rows, : plan.cols].reshape(x.shape)


def reference(world: int, delay: int = 0, eager: bool = False, scale: float = 1.0, model=problem.make_model) -> dict:
    """R replicas: θ₀ after every step, each replica's parameters and e at the end. delay τ > 0
    (overlap): the sync of step s lands at the start of step s + τ (after its gradient, before
    its local step), or at the end, and each replica keeps what it did since: θ ← θ₀ + (θ − θ_s);
    eager: at step s each replica first jumps to θ_s = θ₀ − c α Δ̂_r (its own message, c = scale).
    model: the replicas' model (problem.make_model's by default)."""
    models = [model() for _ in range(world)]
    inners = [_adamw(list(m.parameters())) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    errors = [[torch.zeros_like(p) for p in anchor] for _ in range(world)]
    anchors, in_flight = [], None                                            # (step it lands, Δ̂ per rank, θ_s)

    def land(sent, launched):
        for i in range(len(anchor)):
            total = torch.zeros_like(anchor[i])
            for r in range(world):                                           # rank order
                total = total + sent[r][i]
            anchor[i] = anchor[i] - (total / world) * ALPHA                  # θ₀ ← θ₀ − α Δ̄
        for r, model in enumerate(models):
            for i, p in enumerate(model.parameters()):                       # θ ← θ₀ (+ θ − θ_s)
                p.data = anchor[i].clone() if launched is None else anchor[i] + (p.detach() - launched[r][i])

    for step in range(STEPS):
        for r, model in enumerate(models):
            problem.loss_on(model, *problem.batch(r, step)).backward()
        if in_flight and in_flight[0] == step:
            land(*in_flight[1:])
            in_flight = None
        for inner in inners:
            inner.step()
            inner.zero_grad()
        if step in SYNCS:
            sent = []
            for r, model in enumerate(models):
                mine = []
                for i, p in enumerate(model.parameters()):
                    delta = anchor[i] - p.detach()                           # Δ = θ₀ − θ_r
                    e = torch.add(delta, errors[r][i], alpha=BETA)           # e = β e + Δ (the same float op)
                    mine.append(compress(e))                                 # Δ̂ = Q(TopK(e))
                    errors[r][i] = e - mine[-1]                              # e ← e − Δ̂
                sent.append(mine)
            if eager:
                for r, model in enumerate(models):
                    for i, p in enumerate(model.parameters()):
                        p.data = anchor[i] - sent[r][i] * (scale * ALPHA)         # θ_s = θ₀ − c α Δ̂_r
            if delay:
                in_flight = (step + delay, sent, [[p.detach().clone() for p in m.parameters()] for m in models])
            else:
                land(sent, None)
        anchors.append(torch.cat([a.reshape(-1) for a in anchor]))
    if in_flight:
        land(*in_flight[1:])                                                 # flush()
    return {"anchors": anchors, "final": [problem.flat_params(m) for m in models],
            "errors": [torch.cat([e.reshape(-1) for e in errs]) for errs in errors]}


# ---- what each rank runs ---------------------------------------------------------------------
def _errors(opt) -> torch.Tensor:
    """e of every parameter, flat (DiLoCo, which has none: an empty tensor)."""
    return torch.cat([opt.state[p]["error"].reshape(-1) for p in opt.params if "error" in opt.state[p]] or
                     [torch.zeros(0)])


def _run(rank: int, make, steps: int = STEPS, nan_at: int | None = None, model=problem.make_model) -> dict:
    """`steps` steps on this rank's batches: parameters, payload bytes, θ₀ and e after each."""
    model = model()
    opt = make(list(model.parameters()))
    params, sent, anchors, errors = [], [], [], []
    for step in range(steps):
        problem.loss_on(model, *problem.batch(rank, step)).backward()
        if step == nan_at and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        before = opt.comm_stats.by_tag.get("payload")
        before = before.payload_bytes if before else 0
        opt.step()
        opt.zero_grad()
        params.append(problem.flat_params(model))
        sent.append(opt.comm_stats.by_tag["payload"].payload_bytes - before if "payload" in opt.comm_stats.by_tag
                    else 0)
        anchors.append(torch.cat([opt.state[p]["anchor"].reshape(-1) for p in opt.params]))
        errors.append(_errors(opt))
    opt.flush()
    return {"params": params, "sent": sent, "errors": errors, "final": problem.flat_params(model), "error": _errors(opt),
            "anchor": torch.cat([opt.state[p]["anchor"].reshape(-1) for p in opt.params]),
            "anchors": anchors, "last": opt.comm_stats.last_step.as_dict()}


def _late_gradient(rank: int) -> torch.Tensor:
    """overlap=True by hand: without overlap, each gradient taken at the parameters as they were
    between the previous step's start_step() and finish_step()."""
    model = problem.make_model()
    opt = _sparseloco(list(model.parameters()))
    seen = copy.deepcopy(model)
    for step in range(STEPS):
        seen.zero_grad()
        problem.loss_on(seen, *problem.batch(rank, step)).backward()
        for p, q in zip(model.parameters(), seen.parameters()):
            p.grad = q.grad.clone()
        opt.start_step()
        seen = copy.deepcopy(model)
        opt.finish_step()
        opt.zero_grad()
    return problem.flat_params(model)


def _resumed(rank: int, at: int, **kw) -> torch.Tensor:
    """`at` steps, a state_dict through torch.save into a fresh model and optimizer, the rest."""
    model = problem.make_model()
    opt = _sparseloco(list(model.parameters()), **kw)
    for step in range(at):
        problem.loss_on(model, *problem.batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    fresh = problem.make_model(seed=77)
    fresh.load_state_dict(saved["model"])
    fresh_opt = _sparseloco(list(fresh.parameters()), **kw)
    fresh_opt.load_state_dict(saved["opt"])
    for step in range(at, STEPS):
        problem.loss_on(fresh, *problem.batch(rank, step)).backward()
        fresh_opt.step()
        fresh_opt.zero_grad()
    fresh_opt.flush()
    return problem.flat_params(fresh)


def _wide_model() -> torch.nn.Module:
    """24 -> 32 -> 32 -> 10: with chunk 16 nothing is padded, and the two (32,) biases share a
    chunk shape (1 x 16, k 2), so the compressor packs and reads them as one group."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(problem.IN, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, problem.OUT))


def checks(rank: int, world: int) -> dict:
    plain = dict(topk=CHUNK * CHUNK, values="fp32", error_decay=0.0, outer_lr=1.0)
    return {
        "run": _run(rank, _sparseloco),
        "reference": reference(world),
        "full": _run(rank, lambda ps: _sparseloco(ps, **plain)),
        "diloco": _run(rank, lambda ps: DiLoCo(ps, inner=_adamw, sync_every=H, outer_lr=1.0, outer_momentum=0.0)),
        "overlap": _run(rank, lambda ps: _sparseloco(ps, overlap=True))["final"],
        "late": _late_gradient(rank),
        "resumed": _resumed(rank, 4),
        "resumed_in_flight": _resumed(rank, 6, overlap=True),
        "nan": _run(rank, lambda ps: _sparseloco(ps, nonfinite="skip"), steps=6, nan_at=5),
        "delay2": _run(rank, lambda ps: _sparseloco(ps, overlap=True, delay=2, eager=False)),
        f"delay{H}": _run(rank, lambda ps: _sparseloco(ps, overlap=True, delay=H)),         # eager, the default
        "reference2": reference(world, 2), f"reference{H}": reference(world, H, eager=True),
        "scaled": _run(rank, lambda ps: _sparseloco(ps, overlap=True, delay=H, eager_scale=EAGER_SCALE)),
        "reference_scaled": reference(world, H, eager=True, scale=EAGER_SCALE),
        "wide": _run(rank, lambda ps: _sparseloco(ps, overlap=True, delay=H), model=_wide_model),
        "reference_wide": reference(world, H, eager=True, model=_wide_model),
        "ef": _run(rank, lambda ps: _sparseloco(ps, indices="elias-fano")),
        "ef_wide": _run(rank, lambda ps: _sparseloco(ps, overlap=True, delay=H, indices="elias-fano"),
                        model=_wide_model),
        **{f"nan_eager{e}": _run(rank, lambda ps, e=e: _sparseloco(ps, overlap=True, delay=H, eager=e,
                                                                     nonfinite="skip"), steps=H, nan_at=H - 1)
           for e in (True, False)},
        "resumed_delayed": _resumed(rank, 4, overlap=True, delay=H),      # the sync of step 3 in flight
        "full_delayed": _run(rank, lambda ps: _sparseloco(ps, **plain, overlap=True, delay=H, eager=False)),
        "diloco_delayed": _run(rank, lambda ps: DiLoCo(ps, inner=_adamw, sync_every=H, outer_lr=1.0,
                                                       outer_momentum=0.0, overlap=True, delay=H)),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def outcome(request):
    return request.param, on_world(checks, request.param, timeout=300)


def test_every_sync_matches_the_reference_bit_for_bit(outcome):
    world, ranks = outcome
    for rank, r in enumerate(ranks):
        ref = r["reference"]                          # the same on every rank: each computed its own
        for step in SYNCS:
            assert torch.equal(r["run"]["params"][step], ref["anchors"][step]), (rank, step)
        assert torch.equal(r["run"]["errors"][-1], ref["errors"][rank])


def test_replicas_identical_after_every_sync_and_the_residual_is_per_rank(outcome):
    world, ranks = outcome
    for step in SYNCS:
        for r in ranks[1:]:
            assert torch.equal(r["run"]["params"][step], ranks[0]["run"]["params"][step])
    assert not torch.equal(ranks[0]["run"]["params"][0], ranks[1]["run"]["params"][0])   # local steps differ
    errors = [r["run"]["errors"][-1] for r in ranks]
    assert all(bool(e.abs().sum() > 0) for e in errors)
    assert all(not torch.equal(errors[i], errors[j]) for i in range(world) for j in range(i))


def test_bytes_per_sync_equal_the_wire_formula(outcome):
    world, ranks = outcome
    for r in ranks:
        assert r["run"]["sent"] == [SYNC_BYTES if s in SYNCS else 0 for s in range(STEPS)]
        assert r["run"]["last"] == {"payload_bytes": SYNC_BYTES, "link_bytes_sent": SYNC_BYTES * (world - 1),
                                    "link_bytes_received": SYNC_BYTES * (world - 1), "collectives": 1}


def test_elias_fano_indices_send_fewer_bytes_and_change_no_bit_of_the_training(outcome):
    """A lossless coding: the reference's syncs bit for bit, in the bytes of its formula."""
    world, ranks = outcome
    for rank, r in enumerate(ranks):
        for step in SYNCS:
            assert torch.equal(r["ef"]["params"][step], r["reference"]["anchors"][step]), (rank, step)
        assert torch.equal(r["ef"]["errors"][-1], r["reference"]["errors"][rank])
        assert r["ef"]["sent"] == [EF_SYNC_BYTES if s in SYNCS else 0 for s in range(STEPS)]


def test_no_decay_every_element_fp32_is_plain_averaging(outcome):
    world, ranks = outcome
    for r in ranks:
        for step in SYNCS:
            full, diloco = r["full"]["params"][step], r["diloco"]["params"][step]
            if world == 2:
                assert torch.equal(full, diloco), step
            else:
                torch.testing.assert_close(full, diloco, rtol=1e-6, atol=1e-7)
        assert not r["full"]["errors"][-1].any()      # everything sent exactly: nothing left behind


def test_overlap_is_the_delayed_schedule(outcome):
    _, ranks = outcome
    for r in ranks:
        assert torch.equal(r["overlap"], r["late"])
        assert not torch.equal(r["overlap"], r["run"]["final"])


def test_resume_mid_round_and_with_a_sync_in_flight_is_bit_identical(outcome):
    _, ranks = outcome
    for r in ranks:
        assert torch.equal(r["resumed"], r["run"]["final"])
        assert torch.equal(r["resumed_in_flight"], r["overlap"])


def test_a_skipped_sync_moves_no_anchor_and_no_error(outcome):
    """A NaN on rank 1 at the second sync (step 6), nonfinite='skip': on every rank θ₀ and e
    stay as the first sync (step 3) left them."""
    _, ranks = outcome
    for r in ranks:
        nan, first = r["nan"], SYNCS[0]
        for key in ("anchors", "errors"):
            assert torch.equal(nan[key][5], r["run"][key][first]) and torch.equal(nan[key][5], nan[key][4])
        assert torch.isfinite(nan["final"]).all()


@pytest.mark.parametrize("name, reference_name", [("delay2", "reference2"), (f"delay{H}", f"reference{H}"),
                                                   ("scaled", "reference_scaled"), ("wide", "reference_wide"),
                                                   ("ef_wide", "reference_wide")])
def test_a_delayed_sync_matches_the_reference_bit_for_bit(outcome, name, reference_name):
    """delay τ: θ₀ after every step, each replica at the end and its e, against the reference's
    landing at step s + τ with the replica's own local steps kept (τ = 2 from where it stood,
    τ = H eager: from its jump to θ₀ − c α Δ̂_r, c = 1 and EAGER_SCALE; 'wide': the same on a model
    whose tensors are unpadded and two of them packed as one group; 'ef_wide': that with the
    indices Elias-Fano coded)."""
    _, ranks = outcome
    for rank, r in enumerate(ranks):
        run, ref = r[name], r[reference_name]
        for step in range(STEPS):
            assert torch.equal(run["anchors"][step], ref["anchors"][step]), (rank, step)
        assert torch.equal(run["final"], ref["final"][rank])
        assert torch.equal(run["error"], ref["errors"][rank])               # after flush(): the last sync landed


def test_a_delayed_sync_leaves_at_its_step_and_lands_later(outcome):
    """The bytes still leave at the sync's own step; θ₀ moves τ steps later, the same on every
    rank, while each replica keeps its own local steps (they differ where plain syncs do not)."""
    world, ranks = outcome
    for r in ranks:
        run = r[f"delay{H}"]
        assert run["sent"] == r["run"]["sent"]
        assert torch.equal(run["anchors"][SYNCS[0]], run["anchors"][0])              # not landed yet
        assert not torch.equal(run["anchors"][SYNCS[0] + H], run["anchors"][SYNCS[0]])
    for step in range(STEPS):
        assert all(torch.equal(r[f"delay{H}"]["anchors"][step], ranks[0][f"delay{H}"]["anchors"][step])
                   for r in ranks)
    assert not torch.equal(ranks[0][f"delay{H}"]["params"][SYNCS[0] + H],
                           ranks[1][f"delay{H}"]["params"][SYNCS[0] + H])


def test_resume_with_a_delayed_sync_in_flight_is_bit_identical(outcome):
    _, ranks = outcome
    for r in ranks:
        assert torch.equal(r["resumed_delayed"], r[f"delay{H}"]["final"])


def test_delayed_full_density_is_delayed_plain_averaging(outcome):
    world, ranks = outcome
    for r in ranks:
        full, diloco = r["full_delayed"], r["diloco_delayed"]
        for step in range(STEPS):
            if world == 2:
                assert torch.equal(full["anchors"][step], diloco["anchors"][step]), step
            else:
                torch.testing.assert_close(full["anchors"][step], diloco["anchors"][step], rtol=1e-6, atol=1e-7)


def test_a_skipped_delayed_sync_undoes_the_eager_jump(outcome):
    """A NaN on rank 1 at the first sync, nonfinite='skip', the run ended by flush(): θ₀ and e
    stay as they were, and every rank's replica is back where its local steps left it, as a
    run without the jump (eager=False) ends, to float rounding (θ_s + (θ − θ_s))."""
    _, ranks = outcome
    for r in ranks:
        jumped, plain = r["nan_eagerTrue"], r["nan_eagerFalse"]
        assert torch.equal(jumped["anchor"], jumped["anchors"][0]) and not jumped["error"].any()   # after flush()
        torch.testing.assert_close(jumped["final"], plain["final"], rtol=0, atol=1e-6)
        assert torch.isfinite(jumped["final"]).all()
    assert not torch.equal(ranks[0]["nan_eagerTrue"]["final"], ranks[1]["nan_eagerTrue"]["final"])


@pytest.mark.parametrize("kwargs, name", [
    ({"sync_every": 0}, "sync_every"), ({"topk": 0}, "topk"), ({"topk": 1.5}, "topk"), ({"topk": 257}, "topk"),
    ({"chunk": 0}, "chunk"), ({"values": "sign"}, "values"), ({"indices": "gamma"}, "indices"), ({"transform": "random"}, "transform"),
    ({"error_decay": 1.5}, "error_decay"), ({"error_decay": -0.1}, "error_decay"), ({"outer_lr": 0.0}, "outer_lr"),
    ({"aggregate": "sum"}, "aggregate"), ({"nonfinite": "ignore"}, "nonfinite"), ({"overlap": 1}, "overlap"),
    ({"delay": 2}, "delay"), ({"delay": 0, "overlap": True}, "delay"), ({"delay": 4, "sync_every": 3, "overlap": True}, "delay"),
    ({"delay": 1.0, "overlap": True}, "delay"), ({"eager": 1}, "eager"), ({"eager_scale": -0.5}, "eager_scale"),
    ({"eager_scale": float("inf")}, "eager_scale"), ({"eager_scale": float("nan")}, "eager_scale"),
    ({"eager_scale": True}, "eager_scale"),
    ({"inner": lambda ps: 3}, "inner"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SparseLoCo([torch.nn.Parameter(torch.randn(3))], **{"chunk": 16, **kwargs})


def test_defaults_are_the_papers():
    opt = SparseLoCo([torch.nn.Parameter(torch.randn(64, 64))])
    c = opt.compressor
    assert isinstance(opt.inner, torch.optim.AdamW) and opt.sync_every == 15
    assert (c.topk, c.chunk, c.codec.name, c.transform.kind) == (128, 64, "2bit", "identity")
    assert (opt.error_decay, opt.outer_lr, opt.aggregate) == (0.95, 1.0, "mean")
    assert c.k((64, 64)) == 128 and c.k((32, 64)) == 64 and c.k((64,)) == 2      # 3.1 % everywhere


def test_sparseloco_and_diloco_compose_local_steps_with_their_sync_rule():
    """Issue 47: SparseLoCo is no DiLoCo; both are the inner optimizer's local steps
    (`LocalSteps`) and a sync rule, whose settings the optimizer reads through."""
    assert not issubclass(SparseLoCo, DiLoCo) and issubclass(SparseLoCo, LocalSteps) and issubclass(DiLoCo, LocalSteps)
    sparse = SparseLoCo([torch.nn.Parameter(torch.randn(8, 8))], chunk=8, topk=4, overlap=True, delay=2)
    dense = DiLoCo([torch.nn.Parameter(torch.randn(8, 8))], wire="int8")
    assert isinstance(sparse.sync, SparseTopKSync) and sparse.STORE_EXCHANGE and sparse.sync.jumps
    assert isinstance(dense.sync, DenseMean) and dense.STORE_EXCHANGE and dense.codec is dense.sync.codec
    sparse.grouped = False
    assert sparse.sync.grouped is False and sparse.compressor is sparse.sync.compressor


def _in_flight_after_a_step(state: dict) -> dict:
    """A fresh one-rank SparseLoCo loads `state` (an eager, delayed sync in flight) and takes one
    local step, which sends the loaded sync again without landing it; its state_dict's step in flight."""
    model = problem.make_model()
    opt = _sparseloco(list(model.parameters()), overlap=True, delay=H)
    opt.load_state_dict(state)
    problem.loss_on(model, *problem.batch(0, H)).backward()
    opt.step()
    return opt.state_dict()[INFLIGHT_KEY]["algorithm"]


def test_the_parameters_before_an_eager_jump_travel_with_the_sync_in_flight():
    """One process (world 1): after the sync's step, the checkpoint holds θ before the jump
    ('before_jump': where the same run without the jump stands, and bit for bit through a
    reload); a checkpoint written before that key held the jump's offset θ_before − θ_s
    ('eager_jump'), which loads as θ_before to float rounding."""
    models = [problem.make_model(), problem.make_model()]
    opts = [_sparseloco(list(m.parameters()), overlap=True, delay=H, eager=e) for m, e in zip(models, (True, False))]
    for step in range(H):                                       # the H-th step syncs (and jumps)
        for model, opt in zip(models, opts):
            problem.loss_on(model, *problem.batch(0, step)).backward()
            opt.step()
            opt.zero_grad()
    saved = copy.deepcopy(opts[0].state_dict())
    pending = saved[INFLIGHT_KEY]["algorithm"]
    assert torch.equal(pending["before_jump"], problem.flat_params(models[1]))   # where no jump left it
    assert not torch.equal(pending["launched"], pending["before_jump"])         # the jump moved θ
    reloaded = _in_flight_after_a_step(copy.deepcopy(saved))
    assert torch.equal(reloaded["before_jump"], pending["before_jump"])
    older = copy.deepcopy(saved)
    algorithm = older[INFLIGHT_KEY]["algorithm"]
    algorithm["eager_jump"] = algorithm.pop("before_jump") - algorithm["launched"]
    reloaded = _in_flight_after_a_step(older)
    torch.testing.assert_close(reloaded["before_jump"], pending["before_jump"], rtol=0, atol=1e-6)


def test_the_eager_scale_is_where_the_in_flight_steps_start(outcome):
    """c = EAGER_SCALE moves the replicas off the c = 1 run's (their in-flight gradients are taken
    at θ₀ − c α Δ̂_r); that it moves them exactly there is the reference test's."""
    _, ranks = outcome
    for r in ranks:
        assert not torch.equal(r["scaled"]["final"], r[f"delay{H}"]["final"])


def test_a_sync_in_flight_does_not_resume_under_another_index_coding():
    """One process: a checkpoint with a packed sync in flight, loaded into an Elias-Fano
    SparseLoCo, is refused when it would be sent again (its bytes are another coding's), and
    naming both sizes rather than decoding them as the other coding."""
    model = problem.make_model()
    opt = _sparseloco(list(model.parameters()), overlap=True, delay=H)
    for step in range(H):                                       # the H-th step syncs: in flight
        problem.loss_on(model, *problem.batch(0, step)).backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    fresh = problem.make_model()
    other = _sparseloco(list(fresh.parameters()), overlap=True, delay=H, indices="elias-fano")
    other.load_state_dict(saved)
    problem.loss_on(fresh, *problem.batch(0, H)).backward()
    with pytest.raises(ValueError, match=f"step in flight holds buffers of \\[\\({SYNC_BYTES},\\)\\]"):
        other.step()
