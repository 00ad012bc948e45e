"""The median-norm clip (`thinwire.optim.median_clip`, DeMo's and SparseLoCo's clip='median-norm'):
the device functions against a plain-Python float64 reference, the norms taken from sparse
coefficients against the decoded tensors' (Parseval), the arguments refused, and one 4-rank
gloo run where rank 3 sends 1000x its honest message (below)."""

import math

import pytest
import torch

import thinwire
from thinwire.compress import ChunkedTopK, Payload, SparseLoCoTopK
from thinwire.optim.median_clip import clip_chunks, clip_reads, clip_rows

from ..dist import outcome_of, run_workers


def _reference(rows: list[list[float]], segment: list[int], tensors: int) -> list[list[float]]:
    """The module docstring's equations in float64, one value at a time: lower median of
    the senders' norms per tensor, each sender scaled by min(1, m / n)."""
    norms = [[math.sqrt(sum(v * v for v, t in zip(row, segment) if t == k)) for k in range(tensors)] for row in rows]
    medians = [sorted(n[k] for n in norms)[(len(rows) - 1) // 2] for k in range(tensors)]
    scale = [[1.0 if n[k] <= medians[k] else medians[k] / n[k] for k in range(tensors)] for n in norms]
    return [[v * scale[s][t] for v, t in zip(row, segment)] for s, row in enumerate(rows)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_clip_rows_matches_the_float64_reference_and_leaves_the_unclipped_bit_for_bit(world):
    gen = torch.Generator().manual_seed(world)
    lengths = torch.tensor([3, 2, 4, 1])
    segment = torch.repeat_interleave(torch.arange(4), lengths)
    values = torch.randn(world, segment.numel(), generator=gen) * torch.rand(world, 1, generator=gen) * 10
    if world > 2:
        values[1] = 0.0                                   # a zero row: factor 1, no division by 0
        values[2, segment == 3] = values[0, segment == 3]  # equal norms: neither above the median of both
    got = clip_rows(values, segment, lengths)
    want = torch.tensor(_reference(values.double().tolist(), segment.tolist(), 4), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0.0)
    norms = torch.zeros(world, 4).index_add_(1, segment, values.square()).sqrt()
    untouched = (norms <= norms.median(dim=0).values)[:, segment]           # at or below the median
    assert untouched.any()
    assert torch.equal(got[untouched], values[untouched])
    if world >= 2:
        assert not torch.equal(got, values)


def test_clip_chunks_and_clip_reads_give_clip_rows_values():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 6, 5, generator=gen) * torch.tensor([1.0, 3.0, 0.5, 1000.0])[:, None, None]
    counts = torch.tensor([3, 1, 2])
    chunk_tensor = torch.repeat_interleave(torch.arange(3), counts)
    rows = clip_rows(values.reshape(4, -1), chunk_tensor.repeat_interleave(5), counts * 5)
    torch.testing.assert_close(clip_chunks(values, chunk_tensor, counts).reshape(4, -1), rows, rtol=1e-6, atol=0.0)
    reads = clip_reads([(torch.arange(5), values[s, 3]) for s in range(4)])      # tensor 1 alone
    torch.testing.assert_close(torch.stack([v for _, v in reads]), rows.view(4, 6, 5)[:, 3], rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("transform", ["dct", "identity", "random"])
def test_a_senders_norm_over_a_tensor_is_the_norm_of_its_coefficients(transform):
    """T orthonormal and a chunk's top-k indices distinct: ‖T⁻¹(Q̂)‖ = ‖values‖ (Parseval),
    so the clip needs no decode. A padded tensor's coefficients include what lands in its
    padding, cropped on decode: their norm bounds the decoded one."""
    comp = ChunkedTopK(8, 32, transform, "fp32", 5)
    gen = torch.Generator().manual_seed(1)
    for shape, padded in (((64, 96), False), ((96,), False), ((37, 64), True)):
        x = torch.randn(shape, generator=gen)
        buf = torch.empty(comp.payload_nbytes(shape), dtype=torch.uint8)
        comp.encode(x, buf, 7)
        read = comp.read(Payload.from_buffer(buf, comp.payload_spec(shape)), shape)
        decoded, coefficients = comp.aggregate([read], shape, 7).norm(), read[1].norm()
        assert comp.plan(shape).padded == padded
        if padded:
            assert decoded <= coefficients * (1 + 1e-6)
        else:
            torch.testing.assert_close(decoded, coefficients, rtol=1e-5, atol=0.0)


def test_bad_clip_arguments_raise_value_error_naming_clip():
    p = [torch.nn.Parameter(torch.zeros(8, 8))]
    for bad in ("median", "Median-Norm", True, 1.0):
        with pytest.raises(ValueError, match="clip"):
            thinwire.DeMo(p, clip=bad)
        with pytest.raises(ValueError, match="clip"):
            thinwire.SparseLoCo(p, clip=bad)
    for settings in (dict(transform="dct"), dict(values="fp32"), dict(values="int8")):
        with pytest.raises(ValueError, match="clip='median-norm' runs on the grouped path"):
            thinwire.SparseLoCo(p, clip="median-norm", **settings)
    thinwire.DeMo(p, clip="median-norm")
    thinwire.SparseLoCo(p, clip="median-norm", values="8bit")


@pytest.mark.parametrize("case", ["float64", "per-tensor"])
def test_sparseloco_refuses_to_sync_what_its_clip_cannot_reach_before_anything_moves(case):
    """The clip runs on the grouped landing: a float64 parameter (left to the per-tensor code)
    or grouped=False raise ValueError naming clip at the first sync, before the local step."""
    dtype = torch.float64 if case == "float64" else torch.float32
    params = [torch.nn.Parameter(torch.ones(8, 8, dtype=dtype)), torch.nn.Parameter(torch.ones(8))]
    opt = thinwire.SparseLoCo(params, clip="median-norm", sync_every=1)
    opt.grouped = case != "per-tensor"
    for p in params:
        p.grad = torch.ones_like(p)
    want = "float32, bf16 or fp16: \\[\\(8, 8\\)\\]" if case == "float64" else "set grouped back to True"
    with pytest.raises(ValueError, match="clip='median-norm' runs on the grouped path only.*" + want):
        opt.step()
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)


SHAPES = [(64, 64), (32, 96), (96,)]      # unpadded at chunk 32: Δ's norm is the messages'
ATTACKER, BLOWUP = 3, 1000.0


def _grads(rank: int, attack: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    scale = BLOWUP if attack and rank == ATTACKER else 1.0
    return [torch.randn(s, generator=gen) * scale for s in SHAPES]


def _start() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _norms(comp, xs) -> list[float]:
    """‖Q̂‖ of this rank's message for each tensor: what the wire carries of xs, decoded."""
    out = []
    for x in xs:
        buf = torch.empty(comp.payload_nbytes(x.shape), dtype=torch.uint8)
        comp.encode(x.contiguous(), buf, 0)
        out.append(float(comp.decode(buf, x.shape, 0).norm()))
    return out


def _one_step(make, attack: bool, rank: int) -> list[torch.Tensor]:
    """One step of the optimizer `make(params)` makes; Δ = θ before − θ after, per tensor."""
    params = [torch.nn.Parameter(t) for t in _start()]
    opt = make(params)
    for p, g in zip(params, _grads(rank, attack)):
        p.grad = g
    opt.step()
    return [(s - p.detach()) for s, p in zip(_start(), params)]


def _attacked(rank, world):
    """Per optimizer: Δ of the attacked run clipped ('clip'), unclipped ('plain'), and of the
    honest run ('honest'); this rank's honest and sent message norms per tensor."""
    demo = dict(lr=1.0, beta=0.0, topk=4, chunk=32, base="sgd", values="fp32", momentum_form="reference")
    # SparseLoCo: inner SGD at lr 1, one step a sync, e starts at 0: Δ_r = θ₀ − (θ₀ − g_r) = g_r to rounding
    loco = dict(inner=lambda ps: torch.optim.SGD(ps, lr=1.0), sync_every=1, topk=32, chunk=32, values="8bit")

    def tensorwise(params, **kw):
        opt = thinwire.DeMo(params, **kw)
        opt.grouped = False
        return opt
    makers = {"demo": lambda clip: (lambda ps: thinwire.DeMo(ps, clip=clip, **demo)),
              "demo per-tensor": lambda clip: (lambda ps: tensorwise(ps, clip=clip, **demo)),
              "sparseloco": lambda clip: (lambda ps: thinwire.SparseLoCo(ps, clip=clip, **loco))}
    comps = {"demo": ChunkedTopK(4, 32, "dct", "fp32", 0), "sparseloco": SparseLoCoTopK(32, 32, "identity", "8bit")}
    out = {}
    for name, make in makers.items():
        comp = comps[name.split()[0]]
        out[name] = dict(clip=_one_step(make("median-norm"), True, rank), plain=_one_step(make(None), True, rank),
                         honest=_one_step(make(None), False, rank),
                         honest_norms=_norms(comp, _grads(rank, False)), sent_norms=_norms(comp, _grads(rank, True)))
    for name, make in (("demo", makers["demo"]), ("sparseloco", makers["sparseloco"])):   # rank 3 does not clip
        params = [torch.nn.Parameter(t) for t in _start()]
        opt = make(None if rank == ATTACKER else "median-norm")(params)
        for p, g in zip(params, _grads(rank, False)):
            p.grad = g
        out[name]["mixed"] = outcome_of(opt.step)
    return out


@pytest.fixture(scope="module")
def attacked():
    return run_workers(_attacked, world_size=4)


@pytest.mark.parametrize("name", ["demo", "sparseloco"])
def test_ranks_that_clip_differently_refuse_to_step(attacked, name):
    """The clip is part of what every rank must share: one rank without it raises
    PeerMismatchError on every rank before any payload is sent."""
    for r in attacked:
        kind, message = r[name]["mixed"]
        assert kind == "PeerMismatchError", (kind, message)
        assert "rank 3 disagrees" in message or "disagrees with rank(s) [3]" in message, message


@pytest.mark.parametrize("name", ["demo", "demo per-tensor", "sparseloco"])
def test_one_1000x_sender_is_held_to_the_honest_mean_within_the_median_norm(attacked, name):
    """4 senders, rank 3's message 1000x its honest one. Each clipped contribution c_s is a
    nonnegative multiple of s's honest message q_s with ‖c_s‖ = min(‖sent_s‖, m) (m: the lower
    median of the sent norms, here an honest one), so, per tensor, with A the clipped mean and
    H the honest run's mean, by the triangle inequality

        ‖A − H‖ = ‖(1/W) Σ_s (c_s − q_s)‖ <= (1/W) Σ_s |min(‖sent_s‖, m) − ‖q_s‖|

    which is the honest norms' spread around m plus |m − ‖q_3‖| / W: below m itself. The
    same attack unclipped moves the mean by about 1000 ‖q_3‖ / W (> 100 m)."""
    runs = [r[name] for r in attacked]
    for kind in ("clip", "plain", "honest"):                  # every rank applied the same rows alike
        for r in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[kind], runs[0][kind])), kind
    first = runs[0]
    for t in range(len(SHAPES)):
        honest = [r["honest_norms"][t] for r in runs]
        sent = [r["sent_norms"][t] for r in runs]
        m = sorted(sent)[(len(sent) - 1) // 2]
        bound = sum(abs(min(s, m) - h) for s, h in zip(sent, honest)) / len(runs)
        moved = float((first["clip"][t] - first["honest"][t]).norm())
        assert moved <= bound * (1 + 1e-3) + 1e-4, (t, moved, bound, m)
        assert moved <= m
        assert float((first["plain"][t] - first["honest"][t]).norm()) > 100 * m
