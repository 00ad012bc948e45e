"""The '8bit' codec (thinwire.wire.eightbit, Templar's 256-level statistical quantizer) against
two references written from the algorithm: a plain Python loop over each row in exact-as-
possible float64 (math.fsum), the layout assembled byte by byte with struct; and Templar's
own arithmetic, float32 throughout, shift plus a lookup of centred bin means, as a loop over
numpy float32 scalars."""

import math
import struct

import numpy as np
import pytest
import torch

from thinwire.wire import EightBitCodec, get_codec
from thinwire.wire.twobit import Segments, _bin_sums, _segment_bin_sums, _sorted_bin_sums, quantize_rows, quantize_segments

L, RANGE = 256, 6


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def reference_row(row: list[float]) -> tuple[list[int], list[float]]:
    """(codes, 256 float32 levels) of one row: bins 6σ/256 wide, code 128 centred on the mean,
    the tails clamped into codes 0 and 255; each level the mean of the values coded with it
    (the mean of the row when none is)."""
    n = len(row)
    mu = math.fsum(row) / n
    sigma = math.sqrt(math.fsum((v - mu) ** 2 for v in row) / (n - 1)) if n > 1 else 0.0
    width = RANGE * sigma / L
    if not (width > 0 and math.isfinite(width)):
        width = 1.0
    codes = [min(L - 1, max(0, round((v - mu) / width + L // 2))) for v in row]     # round half to even
    members: list[list[float]] = [[] for _ in range(L)]
    for v, q in zip(row, codes):
        members[q].append(v)
    return codes, [f32(math.fsum(m) / len(m)) if m else f32(mu) for m in members]


def reference_bytes(x: torch.Tensor) -> bytes:
    rows = [reference_row(r) for r in x.tolist()]
    head = b"".join(struct.pack(f"<{L}f", *levels) for _, levels in rows)
    return head + bytes(q for codes, _ in rows for q in codes)                    # one byte a code, row-major


def templar_row(row: list[float]) -> tuple[list[int], list[float]]:
    """Templar's `_quantize_values` then `_dequantize_values` of float32 values, as written
    there: shift = mean, std = ||x − shift|| / sqrt(n − 1), scale = 6 std / 256 (1 if 0 or not
    finite), q = clamp(round(c / scale + 128), 0, 255), lookup = per-bin mean of c (0 when
    empty), decoded lookup[q] + shift; all in float32 (its sums in element order here)."""
    x = [np.float32(v) for v in row]
    n = len(x)
    shift = np.float32(sum(x, np.float32(0)) / np.float32(n))
    c = [v - shift for v in x]
    with np.errstate(divide="ignore", invalid="ignore"):
        std = np.float32(np.sqrt(sum((v * v for v in c), np.float32(0)))) / np.float32(math.sqrt(n - 1))
        scale = np.float32(RANGE) * std / np.float32(L)
    if not (scale != 0 and np.isfinite(scale)):
        scale = np.float32(1.0)
    codes = [int(min(L - 1, max(0, np.round(v / scale + np.float32(L // 2))))) for v in c]
    sums, counts = [np.float32(0)] * L, [0] * L
    for v, q in zip(c, codes):
        sums[q], counts[q] = sums[q] + v, counts[q] + 1
    lookup = [s / np.float32(k) if k else np.float32(0) for s, k in zip(sums, counts)]
    return codes, [float(lookup[q] + shift) for q in codes]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape, scale", [((1, 1), 1.0), ((3, 7), 1.0), ((2, 13), 1e-3), ((4, 64), 1e4),
                                          ((5, 2), 1.0), ((1, 1000), 0.1), ((2, 5000), 1.0)])
def test_bytes_and_decode_match_the_reference(shape, scale):
    x = randn(*shape, seed=shape[1]) * scale
    codec = get_codec("8bit")
    buf = codec.encode(x)
    assert isinstance(codec, EightBitCodec) and codec.nbytes(*shape) == 1024 * shape[0] + x.numel()
    assert buf.numel() == codec.nbytes(*shape)
    assert bytes(buf.tolist()) == reference_bytes(x)
    expected = [[levels[q] for q in codes] for codes, levels in map(reference_row, x.tolist())]
    assert codec.decode(buf, *shape).tolist() == expected


def _bin_width(row: list[float]) -> float:
    return RANGE * float(np.std(row, ddof=1)) / L


def test_templars_float32_arithmetic_gives_the_same_codes_and_values_to_rounding():
    """Templar's own float32 steps on rows centred near 0: every code the same (no value
    within float32 rounding of a bin edge here), every decoded value within 1e-4 of a bin."""
    x = randn(3, 3000, seed=11) * torch.rand(3, 3000, generator=torch.Generator().manual_seed(1)) ** 3
    y = get_codec("8bit").roundtrip(x)
    for row, got in zip(x.tolist(), y):
        want_codes, want = templar_row(row)
        assert want_codes == reference_row(row)[0]
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-4 * _bin_width(row))


def test_a_row_far_from_zero_is_where_templars_float32_rounds_and_this_codec_does_not():
    """Mean 5, spread 1e-4: a bin is 2.3e-6 wide, 5 ulps of 5.0 in float32. Templar's float32
    shift moves codes by one and its levels (lookup + shift, rounded to an ulp of 5) by up to
    about a bin; this codec's levels are the exact bin means rounded once (the reference)."""
    row = (randn(1, 3000, seed=12) * 1e-4 + 5.0)[0].tolist()
    got = get_codec("8bit").roundtrip(torch.tensor([row]))[0].tolist()
    codes, levels = reference_row(row)
    assert got == [levels[q] for q in codes]
    templar_codes, templar = templar_row(row)
    assert max(abs(a - b) for a, b in zip(templar_codes, codes)) == 1
    assert max(abs(a - b) for a, b in zip(templar, got)) < 1.1 * _bin_width(row)


def test_the_tails_clamp_into_the_end_codes_and_a_dense_row_uses_most_codes():
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.tensor([-40.0, 40.0]), torch.randn(20000, generator=gen)]).view(1, -1)
    codes, _ = reference_row(x[0].tolist())
    assert codes[:2] == [0, 255]
    assert len(set(codes)) > 240                                   # ±3σ over 256 bins, 20K normal values
    assert bytes(get_codec("8bit").encode(x).tolist()) == reference_bytes(x)


def test_levels_are_bin_means_so_each_bins_sum_is_kept_and_the_error_is_small():
    x = randn(3, 4000, seed=4)
    y = get_codec("8bit").roundtrip(x)
    for row_x, row_y in zip(x.double(), y.double()):
        for level in row_y.unique():
            members = row_y == level
            assert math.isclose(float(row_x[members].sum()), float(row_y[members].sum()), rel_tol=1e-6, abs_tol=1e-9)
    assert float((y - x).norm() ** 2 / x.norm() ** 2) < 1e-3        # 256 levels of a normal: ~6e-5


def test_zeros_constant_and_empty_rows():
    """(A row with NaN or inf decoding non-finite: tests/wire/test_values.py, every codec.)"""
    codec = get_codec("8bit")
    assert torch.equal(codec.roundtrip(torch.zeros(2, 5)), torch.zeros(2, 5))
    assert torch.equal(codec.roundtrip(torch.full((1, 9), -3.25)), torch.full((1, 9), -3.25))   # σ = 0: one level
    assert codec.roundtrip(torch.zeros(3, 0)).shape == (3, 0) and codec.nbytes(3, 0) == 3 * 1024


def test_low_precision_input_is_coded_like_its_float32_value():
    x = randn(3, 300, seed=2).to(torch.bfloat16)
    codec = get_codec("8bit")
    assert torch.equal(codec.encode(x), codec.encode(x.float()))


def test_sorted_bin_sums_equal_the_bincount_ones():
    """The off-CPU bin sums at 256 levels (a stable sort by bin, then one segmented sum; run
    here on CPU, where both sum each bin in element order) equal bincount's bit for bit."""
    x = torch.cat([randn(3, 2000, seed=1), torch.full((1, 2000), 5.0)]) * 1e-3
    q, _ = quantize_rows(x, L)
    bins = (q + L * torch.arange(4).unsqueeze(1)).view(-1)
    sums, counts = _sorted_bin_sums(bins, x.double().view(-1), 4, L)
    want_sums, want_counts = _bin_sums(q, x.double(), L)
    assert torch.equal(sums, want_sums) and torch.equal(counts.double(), want_counts)


def _rows(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 3000, (5,), generator=gen)] + [1, 2]
    rows = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 6 for n in lengths]
    rows[1].zero_()
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_segments_quantize_each_row_as_on_its_own(seed):
    """`quantize_segments` at 256 levels (the grouped path's), its bincount and its sorted bin
    sums, against `quantize_rows` of each row alone: the same codes and float32 levels."""
    rows = _rows(seed)
    rows[2][3] = float("nan") if seed == 3 else rows[2][3]
    x, segment = torch.cat(rows), Segments([r.numel() for r in rows], "cpu", L)
    q, levels = quantize_segments(x, segment)
    assert levels.shape == (len(rows), L) and levels.is_contiguous()
    sums, counts = _segment_bin_sums(q, x.double(), segment)
    sorted_sums, sorted_counts = _sorted_bin_sums(q + segment.level_of, x.double(), len(rows), L)
    assert torch.equal(sums.view(torch.int64), sorted_sums.view(torch.int64))        # NaN bits too
    assert torch.equal(counts, sorted_counts)
    at = 0
    for j, row in enumerate(rows):
        want_q, want_levels = quantize_rows(row.view(1, -1), L)
        assert torch.equal(q[at: at + row.numel()], want_q.view(-1)), j
        assert torch.equal(levels[j].view(torch.int32), want_levels[0].view(torch.int32)), j
        at += row.numel()
