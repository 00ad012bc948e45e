"""`quantize_segments` (thinwire.wire.twobit): rows of different lengths end to end, quantized
at once with levels per row, against `quantize_rows` of each row alone: the same codes and
the same float32 levels (bit patterns), over rows of one value, zero rows, rows with a NaN
or an inf, and rows whose values span many magnitudes; the masked segment bin sums (a GPU's
path) equal to the bincount ones."""

import pytest
import torch

from thinwire.wire.twobit import Segments, _masked_segment_bin_sums, _segment_bin_sums, quantize_rows, quantize_segments


def _rows(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 700, (6,), generator=gen)] + [1, 2]
    rows = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 6 for n in lengths]
    rows[1].zero_()
    return rows


def _check(rows: list[torch.Tensor]) -> None:
    q, levels = quantize_segments(torch.cat(rows), Segments([r.numel() for r in rows], "cpu"))
    at = 0
    for j, row in enumerate(rows):
        want_q, want_levels = quantize_rows(row.view(1, -1))
        assert torch.equal(q[at: at + row.numel()], want_q.view(-1)), j
        assert torch.equal(levels[j].view(torch.int32), want_levels[0].view(torch.int32)), j
        at += row.numel()


@pytest.mark.parametrize("seed", range(20))
def test_each_row_is_quantized_as_on_its_own(seed):
    _check(_rows(seed))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_row_gets_non_finite_levels_and_leaves_the_others_alone(bad):
    rows = _rows(0)
    rows[2][3] = bad
    _check(rows)
    _, levels = quantize_segments(torch.cat(rows), Segments([r.numel() for r in rows], "cpu"))
    assert not torch.isfinite(levels[2]).any() and torch.isfinite(levels[3]).all()


def test_the_masked_bin_sums_equal_the_bincount_ones():
    """The GPU's form (`_masked_segment_bin_sums`, run here on CPU, where a segment sums in
    element order as bincount does) gives the same float64 sums and counts bit for bit."""
    rows = _rows(3) + [torch.randn(1), torch.randn(700)]
    segment = Segments([r.numel() for r in rows], "cpu")
    x64 = torch.cat(rows).double()
    q = torch.randint(0, 4, x64.shape, generator=torch.Generator().manual_seed(0))
    sums, counts = _segment_bin_sums(q, x64, segment)
    masked_sums, masked_counts = _masked_segment_bin_sums(q, x64, segment)
    assert masked_sums.shape == sums.shape == (len(rows), 4)
    assert torch.equal(masked_sums, sums)
    assert torch.equal(masked_counts, counts.double())


def test_the_levels_are_row_major_on_the_masked_path_too(monkeypatch):
    """A GPU's bin sums (`_masked_segment_bin_sums`) are transposed views; the levels come
    back row-major all the same (`GroupedSparseLoCo.encode` views them flat)."""
    import thinwire.wire.twobit as twobit
    rows = _rows(4)
    x, segment = torch.cat(rows), Segments([r.numel() for r in rows], "cpu")
    want = quantize_segments(x, segment)[1]
    monkeypatch.setattr(twobit, "_segment_bin_sums", _masked_segment_bin_sums)
    levels = quantize_segments(x, segment)[1]
    assert levels.is_contiguous() and torch.equal(levels, want)
