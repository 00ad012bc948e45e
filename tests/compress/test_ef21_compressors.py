"""EF21 compressors: contraction bounds, wire sizes derived by hand, and what each one keeps.

Expected sizes and selections are computed here from the documented formats (sorting,
SVD, float32 bit fields), not taken from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.compress import VALUE_STAGES
from thinwire.compress.dct_topk import DctTopK
from thinwire.compress.spec import parse_compressor
from thinwire.compress.value_stages import get_value_stage
from thinwire.wire import VALUE_FORMATS

SHAPES = [(40, 25), (7, 3, 3, 3), (33,)]
SPECS = ["identity", "natural", "topk:0.05", "topk:0.3+natural", "randk:0.1", "randk:0.2+natural",
         "rank:3", "dct-topk:16:8", "identity+bf16", "topk:0.1+bf16"]
RANDOMISED = ("natural", "randk")


def roundtrip(comp, x, seed=0):
    out = torch.empty(comp.payload_nbytes(x.shape), dtype=torch.uint8)
    comp.encode(x, out, seed)
    return comp.decode(out, x.shape, seed), out


def rel_error(comp, x, seed=0) -> float:
    y, _ = roundtrip(comp, x, seed)
    return float((y - x).double().norm() ** 2 / x.double().norm() ** 2)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_contraction_bound_holds(spec, shape):
    """E||C(x) - x||^2 <= (1 - alpha) ||x||^2, the expectation over seeds for randomised ones."""
    comp = parse_compressor(spec)
    alpha = comp.alpha(shape)
    assert alpha is not None and 0 < alpha <= 1
    gen = torch.Generator().manual_seed(1)
    for trial in range(3):
        x = torch.randn(shape, generator=gen) * (10.0 ** (trial - 1))
        if any(name in spec for name in RANDOMISED):
            mean = sum(rel_error(comp, x, seed) for seed in range(100)) / 100
            assert mean <= (1 - alpha) * 1.05 + 1e-9, (mean, 1 - alpha)   # 5 %: sampling error
        else:
            assert rel_error(comp, x) <= (1 - alpha) + 1e-6


@pytest.mark.parametrize("name", VALUE_STAGES)
def test_value_stages_are_the_value_format_table(name):
    """Every format of thinwire.wire.VALUE_FORMATS but 'signbit' (no magnitude: no EF21
    compressor may use it) is a value stage, sized and flagged by its row."""
    assert VALUE_STAGES == tuple(n for n in VALUE_FORMATS if n != "signbit")
    with pytest.raises(ValueError, match="signbit"):
        get_value_stage("signbit")
    fmt, stage = VALUE_FORMATS[name], get_value_stage(name)
    assert stage.name == name and stage.lossless == fmt.lossless and stage.error_factor == fmt.error_factor
    for n in (1, 7, 1000):
        assert stage.nbytes(n) == 4 * fmt.row_floats + math.ceil(n * fmt.bits / 8)


def test_alpha_values_from_their_definitions():
    assert parse_compressor("topk:0.05").alpha((40, 25)) == 50 / 1000
    assert parse_compressor("randk:0.1").alpha((33,)) == 3 / 33               # round(3.3) = 3
    assert parse_compressor("natural").alpha((5,)) == 7 / 8
    assert parse_compressor("topk:0.05+natural").alpha((40, 25)) == pytest.approx(0.05 * 7 / 8)
    assert parse_compressor("rank:3").alpha((40, 25)) == 3 / 25
    assert parse_compressor("dct-topk:16:8").alpha((40, 25)) == 16 / (8 * 5)  # chunks 8 x 5 (25 = 5 * 5)
    assert parse_compressor("topk:0.1+int8").alpha((40, 25)) is None


def test_wire_sizes_follow_the_documented_formats():
    d = 40 * 25
    assert parse_compressor("identity").payload_nbytes((40, 25)) == 4 * d
    assert parse_compressor("identity+bf16").payload_nbytes((40, 25)) == 2 * d
    assert parse_compressor("natural").payload_nbytes((40, 25)) == math.ceil(d / 8) + d   # 9 bits / value
    k, width = 50, 10                                                 # 1000 values need 10-bit indices
    assert parse_compressor("topk:0.05").payload_nbytes((40, 25)) == math.ceil(k * width / 8) + 4 * k
    assert parse_compressor("topk:0.05+natural").payload_nbytes((40, 25)) == (
        math.ceil(k * width / 8) + math.ceil(k / 8) + k)
    assert parse_compressor("randk:0.05").payload_nbytes((40, 25)) == 4 * k        # no indices
    assert parse_compressor("rank:3").payload_nbytes((40, 25)) == 4 * (40 + 25) * 3
    assert parse_compressor("rank:30").payload_nbytes((40, 25)) == 4 * d           # factors larger: dense
    assert parse_compressor("topk:0.1+int8").payload_nbytes((40, 25)) == math.ceil(100 * 10 / 8) + 4 + 100
    # dct-topk 16 of 8x5 chunks: 25 chunks, 6-bit indices, int8 values with one scale per chunk
    assert parse_compressor("dct-topk:16:8+int8").payload_nbytes((40, 25)) == (
        math.ceil(25 * 16 * 6 / 8) + 25 * 4 + 25 * 16)


@pytest.mark.parametrize("ratio, k", [(0.05, 50), (0.3, 300)])     # bit-packed indices, bitmap
def test_topk_keeps_exactly_the_largest_entries(ratio, k):
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(2))
    y, _ = roundtrip(parse_compressor(f"topk:{ratio}"), x)
    order = x.abs().flatten().argsort(descending=True)
    expected = torch.zeros(1000)
    expected[order[:k]] = x.flatten()[order[:k]]
    assert torch.equal(y.flatten(), expected)


def test_topk_positions_travel_as_a_bitmap_when_that_is_smaller():
    d = 40 * 25                                                       # 10-bit indices
    # K = 300: 300 x 10 bits = 375 bytes of indices > a 125-byte bitmap
    assert parse_compressor("topk:0.3+int8").payload_nbytes((40, 25)) == d // 8 + 4 + 300
    # K = 100: 125 bytes either way: indices stay bit-packed (the bitmap only when smaller)
    comp = parse_compressor("topk:0.1+int8")
    assert comp.payload_nbytes((40, 25)) == math.ceil(100 * 10 / 8) + 4 + 100 and not comp.bitmap((40, 25))
    # the bitmap's bits are the kept positions, least significant bit first within a byte
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(4))
    _, out = roundtrip(parse_compressor("topk:0.3"), x)
    bits = torch.tensor([(int(out[i // 8]) >> (i % 8)) & 1 for i in range(d)], dtype=torch.bool)
    assert torch.equal(bits, x.abs().flatten() >= x.abs().flatten().sort(descending=True).values[299])


def test_bitmap_with_the_wrong_number_of_positions_is_rejected():
    comp = parse_compressor("topk:0.3")
    _, out = roundtrip(comp, torch.randn(40, 25))
    flipped = out.clone()
    flipped[:125] = 0xFF                                              # every position marked
    with pytest.raises(ValueError, match="bitmap marks 1000 positions, expected 300"):
        comp.decode(flipped, (40, 25))


def test_randk_indices_come_from_the_seed_and_values_are_unscaled():
    comp, x = parse_compressor("randk:0.1"), torch.randn(33, generator=torch.Generator().manual_seed(3))
    y, out = roundtrip(comp, x, seed=5)
    kept = y != 0
    assert int(kept.sum()) == 3 and torch.equal(y[kept], x[kept])          # unscaled: x itself
    assert torch.equal(comp.decode(out, x.shape, 5), y)                     # receiver regenerates
    supports = {tuple(roundtrip(comp, x, s)[0].nonzero().flatten().tolist()) for s in range(20)}
    assert len(supports) > 1                                                # the seed moves them


def _neighbour_powers(x):
    e = torch.floor(torch.log2(x.abs().double()))
    return 2.0 ** e, 2.0 ** (e + 1)


def test_natural_rounds_to_a_neighbouring_power_of_two_unbiased():
    comp = parse_compressor("natural")
    x = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 3
    low, high = _neighbour_powers(x)
    samples = torch.stack([roundtrip(comp, x, s)[0].double() for s in range(2000)])
    mags = samples.abs()
    assert bool(((mags == low) | (mags == high)).all())
    assert bool((samples.sign() == x.sign()).all())
    p_up = ((x.abs().double() - low) / low)                               # unbiased probability
    assert torch.allclose((mags == high).double().mean(0), p_up, atol=0.05)
    assert torch.allclose(samples.mean(0), x.double(), rtol=0.05, atol=0.02)


def test_natural_zero_and_nonfinite():
    comp = parse_compressor("natural")
    y, _ = roundtrip(comp, torch.tensor([0.0, -0.0, 1.0, -2.0]))
    assert y.tolist() == [0.0, 0.0, 1.0, -2.0]                            # powers of two are exact
    with pytest.raises(ValueError, match="non-finite"):
        roundtrip(comp, torch.tensor([1.0, float("nan")]))


def test_composition_is_topk_then_natural():
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(6))
    y, _ = roundtrip(parse_compressor("topk:0.05+natural"), x, seed=9)
    order = x.abs().flatten().argsort(descending=True)[:50]
    assert set(y.flatten().nonzero().flatten().tolist()) == set(order.tolist())
    low, high = _neighbour_powers(x.flatten()[order])
    got = y.flatten()[order].abs().double()
    assert bool(((got == low) | (got == high)).all())


def test_rank_k_is_the_truncated_svd():
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    y, _ = roundtrip(parse_compressor("rank:3"), x.float())
    s = torch.linalg.svdvals(x)
    assert (y.double() - x).norm() ** 2 == pytest.approx(float((s[3:] ** 2).sum()), rel=1e-4)


def test_dct_topk_matches_chunked_topk():
    from thinwire.compress import ChunkedTopK
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(8))
    inner = ChunkedTopK(16, 8, "dct", "fp32")
    y, _ = roundtrip(parse_compressor("dct-topk:16:8"), x)
    assert torch.equal(y, roundtrip(inner, x)[0])
    assert DctTopK.wrap(inner).name == "dct-topk:16:8"


def test_malformed_topk_index_is_rejected():
    comp, x = parse_compressor("topk:0.5"), torch.randn(5)                   # 3 indices of 3 bits
    _, out = roundtrip(comp, x)
    out[0] = 0xFF                                                            # index 7 >= 5
    with pytest.raises(ValueError, match="out of range"):
        comp.decode(out, x.shape)


@pytest.mark.parametrize("spec, fragment", [
    ("gzip", "unknown compressor"), ("topk:0", "(0, 1]"), ("topk:1.5", "(0, 1]"), ("randk:-0.1", "(0, 1]"),
    ("rank:0", ">= 1"), ("dct-topk:0", ">= 1"), ("topk:0.1+zip", "unknown value stage"),
    ("natural+natural", "value stage"), ("topk:x", "ratio"), ("dct-topk:32+natural", "values"),
    ("topk:0.1+natural+bf16", "at most one"),
])
def test_bad_specs_raise_naming_the_argument(spec, fragment):
    with pytest.raises(ValueError, match="uplink=") as info:
        parse_compressor(spec, "uplink")
    assert fragment in str(info.value)
