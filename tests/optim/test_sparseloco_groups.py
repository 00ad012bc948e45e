"""SparseLoCo's grouped sync (`thinwire.optim.sparseloco_groups`) against its per-tensor path
(`opt.grouped = False`, the reference): the same parameters, anchors and error feedback bit
for bit after every step, the same messages byte for byte, over the schedules (blocking,
overlap, delayed with and without the eager jump), aggregations, index codings, a padded
shape (joined), and bf16 / fp16 parameters (joined, alone with other value formats, mixed
with float32, both narrow dtypes in one layout, float64 alone beside them); one process,
world 1. Every rank's rows in rank order: tests/optim/test_sparseloco.py and the registry
suite, at 2 and 3 ranks."""

import pytest
import torch

import thinwire

# chunk 16: (64, 32), (32, 32), (16, 64) of 16 x 16 chunks (one family, two column counts);
# (96,), (48,), (16,) of 1 x 16; (40,) of 1 x 10 (k 1); (37, 24) pads its rows (a family of its own)
SHAPES = [(64, 32), (96,), (37, 24), (32, 32), (48,), (16, 64), (40,), (16,), (64, 32)]
SETTINGS = [dict(), dict(overlap=True), dict(overlap=True, delay=3), dict(overlap=True, delay=3, eager=False),
            dict(overlap=True, delay=2, eager_scale=1.5), dict(aggregate="senders"), dict(outer_lr=0.8),
            dict(indices="elias-fano", overlap=True, delay=3), dict(values="int8"), dict(transform="dct")]


def _run(grouped: bool, steps: int = 10, dtypes=None, flush: bool = True, **kw):
    gen = torch.Generator().manual_seed(0)
    dtypes = dtypes or [torch.float32] * len(SHAPES)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(SHAPES, dtypes)]
    eps = 1e-3 if torch.float16 in dtypes else 1e-8              # fp16's AdamW: 1e-8 is 0, and 0 / 0 at v = 0
    opt = thinwire.SparseLoCo(params, inner=lambda q: torch.optim.AdamW(q, lr=1e-2, eps=eps), sync_every=3, topk=32,
                              chunk=16, error_decay=0.9, **kw)
    opt.grouped = grouped
    grads = torch.Generator().manual_seed(1)
    history = []
    for t in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads).to(p.dtype)
        opt.step()
        state = [(p.detach().clone(), opt.state[p]["anchor"].clone(), opt.state[p]["error"].clone()) for p in params]
        message = opt.sync.message.buffer.clone() if opt.sync.message.buffer is not None else None
        history.append((state, message))
    if kw.get("overlap") and flush:
        opt.flush()
    return params, opt, history


def _same(ours, ref) -> None:
    (a, b), (c, d) = ours, ref
    for t, (step, want) in enumerate(zip(a, c)):
        for i, (x, y) in enumerate(zip(step[0], want[0])):
            for name, u, v in zip(("param", "anchor", "error"), x, y):
                assert torch.equal(u, v), (t, i, name)
        assert (step[1] is None) == (want[1] is None) and (step[1] is None or torch.equal(step[1], want[1])), t
    for p, q in zip(b, d):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw", SETTINGS, ids=str)
def test_the_grouped_sync_follows_the_per_tensor_path_bit_for_bit(kw):
    ours, opt, history = _run(True, **kw)
    ref, _, ref_history = _run(False, **kw)
    _same((history, ours), (ref_history, ref))
    joined = opt.sync._grouped.tensors
    if kw.get("values") or kw.get("transform"):
        assert joined == []
    else:
        assert sorted(joined) == list(range(len(SHAPES)))


F32, BF16, FP16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
# both families and the padded shape mix dtypes: 16 x 16 (64, 32) bf16, (32, 32) f32, ...
LAYOUTS = {"bf16": [BF16] * len(SHAPES), "fp16": [FP16] * len(SHAPES),
           "f32+bf16": [BF16, F32, BF16, F32, BF16, BF16, F32, BF16, F32],
           "f32+bf16+fp16": [BF16, FP16, F32, FP16, BF16, F32, BF16, FP16, FP16],     # each narrow dtype via the spare
           "f64+bf16": [F64, BF16, F32, BF16, F64, BF16, F32, BF16, BF16]}             # float64 alone
NARROW_CASES = ([("bf16", kw) for kw in SETTINGS if not (kw.get("values") or kw.get("transform"))]
                + [(name, kw) for name in ("fp16", "f32+bf16", "f32+bf16+fp16")
                   for kw in (dict(), dict(overlap=True, delay=3), dict(overlap=True, delay=3, eager=False),
                              dict(overlap=True, delay=2, eager_scale=1.5, outer_lr=0.8))]
                + [("f64+bf16", dict(overlap=True, delay=3)), ("f32+bf16", dict(aggregate="senders", overlap=True))])


@pytest.mark.parametrize("layout, kw", NARROW_CASES, ids=str)
def test_narrow_parameters_join_and_follow_the_per_tensor_path_bit_for_bit(layout, kw):
    """bf16 / fp16 θ and θ₀ round where the per-tensor path rounds them (Δ, e, e' float32)."""
    dtypes = LAYOUTS[layout]
    ours, opt, history = _run(True, dtypes=dtypes, **kw)
    ref, _, ref_history = _run(False, dtypes=dtypes, **kw)
    _same((history, ours), (ref_history, ref))
    assert sorted(opt.sync._grouped.tensors) == [i for i, d in enumerate(dtypes) if d != F64]
    assert opt.sync._grouped.alone == [i for i, d in enumerate(dtypes) if d == F64]


@pytest.mark.parametrize("kw", [dict(values="int8"), dict(values="fp32", overlap=True, delay=3),
                                dict(values="int8", overlap=True, delay=2, eager_scale=1.5)], ids=str)
def test_every_parameter_alone_bf16_changes_nothing(kw):
    """Tensors alone are encoded one after the other: each one's Sent must be used before the
    next one's encode reuses the compressor's scratch."""
    dtypes = [torch.bfloat16] * len(SHAPES)
    ours, opt, history = _run(True, dtypes=dtypes, **kw)
    ref, _, ref_history = _run(False, dtypes=dtypes, **kw)
    _same((history, ours), (ref_history, ref))
    assert opt.sync._grouped.tensors == []


@pytest.mark.parametrize("layout", [None, "f32+bf16"])
def test_a_grouped_sync_in_flight_lands_alike_on_the_per_tensor_path(layout):
    """The pending state (e', θ_s, θ before the jump) has one layout on both paths."""
    dtypes = LAYOUTS.get(layout)
    ours, opt, _ = _run(True, steps=7, flush=False, dtypes=dtypes, overlap=True, delay=3)
    ref, ref_opt, _ = _run(False, steps=7, flush=False, dtypes=dtypes, overlap=True, delay=3)
    opt.grouped = False                                  # the landing of a grouped sync, per tensor
    grads = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q in zip(ours, ref):
            p.grad = q.grad = torch.randn(p.shape, generator=grads).to(p.dtype)
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)
