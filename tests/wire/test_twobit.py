"""The '2bit' codec (thinwire.wire.twobit) against an obviously correct reference: a plain
Python loop over each row, the layout assembled byte by byte with struct."""

import math
import struct

import pytest
import torch

from thinwire.wire import TwoBitCodec, get_codec
from thinwire.wire.twobit import _bin_sums, _masked_bin_sums, quantize_rows


def reference_row(row: list[float]) -> tuple[list[int], list[float]]:
    """(codes, 4 float32 levels) of one row: bins 6σ/4 wide around the mean, each level the
    mean of the values in its bin (the mean of the row when none is)."""
    n = len(row)
    mu = math.fsum(row) / n
    sigma = math.sqrt(math.fsum((v - mu) ** 2 for v in row) / (n - 1)) if n > 1 else 0.0
    width = 6 * sigma / 4
    if not (width > 0 and math.isfinite(width)):
        width = 1.0
    codes = [min(3, max(0, round((v - mu) / width + 2))) for v in row]       # round half to even
    levels = []
    for b in range(4):
        members = [v for v, q in zip(row, codes) if q == b]
        levels.append(math.fsum(members) / len(members) if members else mu)
    return codes, [struct.unpack("<f", struct.pack("<f", t))[0] for t in levels]


def reference_bytes(x: torch.Tensor) -> bytes:
    rows = [reference_row(r) for r in x.tolist()]
    head = b"".join(struct.pack("<4f", *levels) for _, levels in rows)
    codes = [q for row_codes, _ in rows for q in row_codes]                 # row-major
    codes += [0] * (-len(codes) % 4)
    packed = bytes(codes[i] | codes[i + 1] << 2 | codes[i + 2] << 4 | codes[i + 3] << 6
                   for i in range(0, len(codes), 4))
    return head + packed


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape, scale", [((1, 1), 1.0), ((3, 7), 1.0), ((2, 13), 1e-3), ((4, 64), 1e4),
                                          ((5, 2), 1.0), ((1, 1000), 0.1)])
def test_bytes_and_decode_match_the_reference(shape, scale):
    x = randn(*shape, seed=shape[1]) * scale
    codec = get_codec("2bit")
    buf = codec.encode(x)
    assert isinstance(codec, TwoBitCodec) and codec.nbytes(*shape) == 16 * shape[0] + math.ceil(x.numel() / 4)
    assert bytes(buf.tolist()) == reference_bytes(x)
    expected = [[levels[q] for q in codes] for codes, levels in map(reference_row, x.tolist())]
    assert codec.decode(buf, *shape).tolist() == expected


def test_skewed_rows_use_every_level_and_the_clamped_tails():
    small = [0.1 * (i % 5 - 2) for i in range(17)]
    x = torch.tensor([[-10.0, -3.5, 3.0, *small], [5.0] * 20])        # -10: below the range, clamped to 0
    codec = get_codec("2bit")
    assert bytes(codec.encode(x).tolist()) == reference_bytes(x)
    codes, _ = reference_row(x[0].tolist())
    assert codes[:4] == [0, 1, 3, 2] and set(codes) == {0, 1, 2, 3}
    assert torch.equal(codec.roundtrip(x)[1], x[1])                   # σ = 0: one level, the value itself


def test_levels_are_bin_means_so_each_bins_sum_is_kept():
    x = randn(3, 200, seed=4)
    y = get_codec("2bit").roundtrip(x)
    for row_x, row_y in zip(x.double(), y.double()):
        for level in row_y.unique():
            members = row_y == level
            assert math.isclose(float(row_x[members].sum()), float(row_y[members].sum()), rel_tol=1e-6)
    assert float((y - x).norm() ** 2 / x.norm() ** 2) < 0.2              # 4 levels of a normal: ~0.12


def test_zeros_empty_and_non_finite_rows():
    codec = get_codec("2bit")
    assert torch.equal(codec.roundtrip(torch.zeros(2, 5)), torch.zeros(2, 5))
    assert codec.roundtrip(torch.zeros(3, 0)).shape == (3, 0) and codec.nbytes(3, 0) == 48
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = randn(2, 9, seed=1)
        x[1, 4] = bad
        y = codec.roundtrip(x)
        assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any()


def test_low_precision_input_is_coded_like_its_float32_value():
    x = randn(3, 11, seed=2).to(torch.bfloat16)
    codec = get_codec("2bit")
    assert torch.equal(codec.encode(x), codec.encode(x.float()))


def test_masked_bin_sums_agree_with_the_reference_levels():
    """The off-CPU bin sums (masked reductions, run here on CPU) give every row's reference
    levels: the counts exactly, the sums to float64 rounding, so float32 levels alike."""
    x = torch.cat([randn(3, 500, seed=1), torch.tensor([[5.0] * 500])]) * 1e-3  # the last row: one level
    q, levels = quantize_rows(x)
    sums, counts = _masked_bin_sums(q, x.double())
    cpu_sums, cpu_counts = _bin_sums(q, x.double())
    assert torch.equal(counts, cpu_counts)
    assert torch.allclose(sums, cpu_sums, rtol=1e-12, atol=0.0)
    masked = torch.where(counts > 0, sums / counts.clamp(min=1), x.double().mean(dim=1, keepdim=True)).float()
    assert masked.tolist() == [reference_row(row)[1] for row in x.tolist()] == levels.tolist()
