"""EF21 compressors over many tensors at once (`thinwire.compress.ef21_blocks`): the bytes
are the per-tensor compressor's (read back by its own `decode`), the sum over ranks is the
per-tensor decodes' sum in rank order, what arrived malformed is flagged on the device, the
device draws keep Rand-K uniform and natural rounding unbiased, and neither encode nor land
reads the host or launches more for more tensors.

Expected values come from the per-tensor compressors (`TopK`, `RandK`, `Identity`, whose own
tests derive them from the documented formats) and from sorting and counting here.
"""

from __future__ import annotations

import pytest
import torch

from thinwire.audit import StepAudit
from thinwire.compress.ef21_blocks import BlockLink, groupable
from thinwire.compress.spec import parse_compressor

SHAPES = [(64, 16), (16,), (16, 48), (48,), (16, 16), (16,), (16, 64), (64,), (64, 16), (16,), (40, 25), (7,), (3,)]
DETERMINISTIC = ["topk:0.05", "topk:0.3", "topk:0.1+bf16", "topk:0.3+fp16", "topk:0.44+int8", "identity",
                 "identity+bf16", "identity+int8"]
PREFIX = 11                                    # the members' payloads start past a prefix, unaligned


def _link(spec, shapes=SHAPES):
    comp = parse_compressor(spec)
    sizes = [comp.payload_nbytes(s) for s in shapes]
    offsets = [PREFIX + sum(sizes[:i]) for i in range(len(sizes))]
    return comp, BlockLink(comp, shapes, offsets, "cpu"), offsets, sizes


def _flat(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _encode(link, xs, offsets, sizes, seed=5):
    payload = torch.zeros(PREFIX + sum(sizes), dtype=torch.uint8)
    link.encode(torch.cat([x.reshape(-1) for x in xs]), payload, seed, seed + 1)
    return payload


def _per_tensor(comp, payload, offsets, sizes, shapes=SHAPES, seed=0):
    return torch.cat([comp.decode(payload[o: o + n], s, seed).reshape(-1) for s, o, n in zip(shapes, offsets, sizes)])


@pytest.mark.parametrize("spec", DETERMINISTIC + ["topk:0.05+natural", "natural"])
def test_the_per_tensor_decode_reads_the_block_form_bytes(spec):
    comp, link, offsets, sizes = _link(spec)
    xs = _flat(SHAPES, 0)
    payload = _encode(link, xs, offsets, sizes)
    landed = torch.empty(sum(x.numel() for x in xs))
    assert not link.land(payload[None], [5], landed)
    assert torch.equal(landed, _per_tensor(comp, payload, offsets, sizes))
    if spec in DETERMINISTIC:                  # what the per-tensor compressor itself sends, decoded
        expected = []
        for x, n in zip(xs, sizes):
            own = torch.empty(n, dtype=torch.uint8)
            comp.encode(x, own)
            expected.append(comp.decode(own, x.shape).reshape(-1))
        assert torch.equal(landed, torch.cat(expected))
    assert torch.equal(payload[:PREFIX], torch.zeros(PREFIX, dtype=torch.uint8))     # nothing else written


def test_identity_bytes_are_the_per_tensor_bytes():
    comp, link, offsets, sizes = _link("identity+bf16")
    xs = _flat(SHAPES, 1)
    payload = _encode(link, xs, offsets, sizes)
    for x, o, n in zip(xs, offsets, sizes):
        own = torch.empty(n, dtype=torch.uint8)
        comp.encode(x, own)
        assert torch.equal(payload[o: o + n], own)


@pytest.mark.parametrize("spec", DETERMINISTIC + ["randk:0.2", "randk:0.1+natural", "randk:0.3+int8", "natural"])
def test_land_is_the_sum_of_every_ranks_decode_in_rank_order(spec):
    comp, link, offsets, sizes = _link(spec)
    rows, seeds = [], [3, 8, 13]
    for r, seed in enumerate(seeds):
        rows.append(_encode(link, _flat(SHAPES, 10 + r), offsets, sizes, seed))
    landed = torch.empty(sum(torch.Size(s).numel() for s in SHAPES))
    assert not link.land(torch.stack(rows), seeds, landed)
    singles = []
    for row, seed in zip(rows, seeds):
        one = torch.empty_like(landed)
        link.land(row[None], [seed], one)
        singles.append(one)
        if not spec.startswith("randk"):                       # Rand-K's positions: the block form's draws
            assert torch.equal(one, _per_tensor(comp, row, offsets, sizes))
    assert torch.equal(landed, singles[0] + singles[1] + singles[2])


def test_the_encoders_own_record_is_what_receivers_decode():
    for spec in ("topk:0.05+natural", "randk:0.1+bf16", "topk:0.3", "topk:0.2+int8"):
        comp, link, offsets, sizes = _link(spec)
        payload = _encode(link, _flat(SHAPES, 2), offsets, sizes, seed=4)
        own, landed = torch.empty(link.numel), torch.empty(link.numel)
        assert link.sent(own)
        link.land(payload[None], [4], landed)
        assert torch.equal(own, landed)
        link.forget()
        assert not link.sent(own)


def test_malformed_payloads_are_flagged_on_the_device():
    comp, link, offsets, sizes = _link("topk:0.5", [(5,), (5,)])                # 3 indices of 3 bits each
    payload = _encode(link, _flat([(5,), (5,)], 3), offsets, sizes)
    out = torch.empty(10)
    bad = payload.clone()
    bad[offsets[1]] = 0xFF                                                      # index 7 >= 5
    assert link.land(bad[None], [5], out).item() and not link.land(payload[None], [5], out).item()
    comp, link, offsets, sizes = _link("topk:0.3", [(40, 25), (7, 3, 3, 3)])    # bitmaps
    payload = _encode(link, _flat([(40, 25), (7, 3, 3, 3)], 3), offsets, sizes)
    flipped = payload.clone()
    flipped[offsets[0]: offsets[0] + 125] = 0xFF                                # every position marked
    out = torch.empty(1000 + 189)
    assert link.land(flipped[None], [5], out).item() and not link.land(payload[None], [5], out).item()
    comp, link, offsets, sizes = _link("natural", [(6,)])
    payload = _encode(link, [torch.ones(6)], offsets, sizes)
    payload[offsets[0] + 1 + 2] = 255                                           # an exponent of inf
    assert link.land(payload[None], [5], torch.empty(6)).item()


def test_rand_k_draws_a_uniform_k_subset_per_tensor():
    """Each position is kept with probability K/d (so (d/K)·C(x) is unbiased), each tensor
    keeps exactly K, and the kept values are x's own (unscaled)."""
    shapes = [(10, 10), (100,), (10,)]
    comp, link, offsets, sizes = _link("randk:0.2", shapes)
    xs = [torch.rand(s) + 1.0 for s in shapes]                                # no zeros: kept <=> nonzero
    flat = torch.cat([x.reshape(-1) for x in xs])
    trials, counts = 1500, torch.zeros(flat.numel())
    for seed in range(trials):
        out = torch.empty_like(flat)
        link.land(_encode(link, xs, offsets, sizes, seed)[None], [seed], out)
        kept = out != 0
        assert torch.equal(out[kept], flat[kept])
        assert [int(k.sum()) for k in kept.split([100, 100, 10])] == [20, 20, 2]
        counts += kept
    frequency = counts / trials
    assert torch.allclose(frequency, torch.full_like(frequency, 0.2), atol=0.045)   # ~4.4 standard errors
    assert abs(float(frequency.mean()) - 0.2) < 0.005


def test_natural_rounding_drawn_on_the_device_is_unbiased():
    comp, link, offsets, sizes = _link("natural", [(64,)])
    x = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 3
    e = torch.floor(torch.log2(x.abs().double()))
    low, high = 2.0 ** e, 2.0 ** (e + 1)
    samples = []
    for seed in range(2000):
        out = torch.empty(64)
        link.land(_encode(link, [x], offsets, sizes, seed)[None], [seed], out)
        samples.append(out.double())
    samples = torch.stack(samples)
    assert bool(((samples.abs() == low) | (samples.abs() == high)).all()) and bool((samples.sign() == x.sign()).all())
    assert torch.allclose((samples.abs() == high).double().mean(0), (x.abs().double() - low) / low, atol=0.05)
    assert torch.allclose(samples.mean(0), x.double(), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("spec", ["topk:0.05", "topk:0.3+natural", "topk:0.44+int8", "randk:0.1", "identity+bf16",
                                  "natural"])
def test_encode_and_land_read_nothing_and_launch_the_same_for_more_tensors(spec):
    counts = []
    for repeat in (2, 5):                   # every block of two or more tensors (one is a view, not a cat)
        shapes = SHAPES * repeat
        comp, link, offsets, sizes = _link(spec, shapes)
        xs = _flat(shapes, 6)
        audit = StepAudit()
        with audit:
            payload = _encode(link, xs, offsets, sizes)
            link.land(torch.stack([payload, payload]), [5, 5], torch.empty(sum(x.numel() for x in xs)))
        counts.append(audit.launches)
        assert audit.host_reads == 0 and audit.host_values == 0, audit.summary()
    assert counts[0] == counts[1]


def test_which_compressors_have_a_block_form():
    assert all(groupable(parse_compressor(s)) for s in ("topk:0.1", "randk:0.1+fp16", "natural", "identity+bf16",
                                                        "topk:0.1+int8"))
    assert not any(groupable(parse_compressor(s)) for s in ("topk:0.1+2bit", "rank:2", "dct-topk:4:8", "identity+sign"))
    with pytest.raises(ValueError, match="block form"):
        BlockLink(parse_compressor("rank:2"), [(4, 4)], [0], "cpu")


@pytest.mark.parametrize("spec", ["topk:0.05", "identity+bf16", "natural"])
def test_members_whose_bytes_are_apart_are_written_in_place_and_nothing_between(spec):
    """A link over every other member's payload (another dtype's link holds the rest): its
    bytes land where the per-tensor format puts them, the gaps stay as they were."""
    comp = parse_compressor(spec)
    sizes = [comp.payload_nbytes(s) for s in SHAPES]
    offsets = [PREFIX + sum(sizes[:i]) for i in range(len(sizes))]
    mine = list(range(0, len(SHAPES), 2))
    link = BlockLink(comp, [SHAPES[i] for i in mine], [offsets[i] for i in mine], "cpu")
    xs = _flat([SHAPES[i] for i in mine], 7)
    payload = torch.full((PREFIX + sum(sizes),), 0xAB, dtype=torch.uint8)
    link.encode(torch.cat([x.reshape(-1) for x in xs]), payload, 5, 6)
    landed = torch.empty(sum(x.numel() for x in xs))
    link.land(payload[None], [5], landed)
    assert torch.equal(landed, torch.cat([comp.decode(payload[offsets[i]: offsets[i] + sizes[i]], SHAPES[i]).reshape(-1)
                                          for i in mine]))
    for i in range(1, len(SHAPES), 2):
        assert bool((payload[offsets[i]: offsets[i] + sizes[i]] == 0xAB).all())
