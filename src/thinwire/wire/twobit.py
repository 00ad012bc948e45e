"""The '2bit' value format: SparseLoCo's statistical quantizer (Sarfi et al., arXiv 2508.15706),
4 levels per row, each level the mean of the values coded with it.

For one row of n values x (any float dtype; statistics in float64):

    μ = mean(x)                                   the row's centre
    σ = sqrt(Σ (x − μ)² / (n − 1))                its unbiased deviation (0 when n <= 1)
    s = R σ / L                                   bin width: R = 6 sigmas over L = 4 levels;
                                                  s = 1 where that is 0 or not finite
    q = clamp(round((x − μ) / s + L/2), 0, L−1)   the 2-bit code (round half to even)
    t_b = mean of the x with q = b                the level of code b (μ when no value has it),
                                                  rounded once to float32
    decode: x̂ = t_q

That is the quantizer of SparseLoCo's reference code (tplr's `TopKCompressor._quantize`, after
hivemind's 8-bit 'statistical' quantization, with 4 bins and a range of 6 sigmas): it sends the
mean μ and the per-bin means of x − μ (a lookup of 4), and decodes lookup[q] + μ; this codec
sends their sums t_b (4 floats, not 5), the same levels up to that one rounding.

Layout of a [rows, cols] tensor: rows × 4 float32 levels t (row-major), then
packed_nbytes(rows·cols, 2) bytes of codes, `pack_bits(q, 2)` of the row-major codes (4 per
byte, least significant bits first): 16·rows + ceil(rows·cols / 4) bytes.

A row holding NaN or inf gets NaN levels (t + (μ − μ)), so it decodes non-finite; a row of
zeros decodes to zeros; a row with no columns has levels 0.
"""

from __future__ import annotations

import torch

from .bits import pack_bits, packed_nbytes, unpack_bits
from .values import ValueCodec, _as_dtype, _bytes_of, _dim

LEVELS = 4              # 2 bits
RANGE_SIGMAS = 6.0      # the reference's quantization_range


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (codes q [rows, cols] int64 in 0..3, levels t [rows, 4] float32)."""
    return quantize_row_groups(x, torch.arange(x.shape[0], device=x.device), x.shape[0])


def quantize_row_groups(x: torch.Tensor, group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer over groups of whole rows: every value of x [rows, cols] whose row i has
    group[i] = g (int64 [rows], in 0..groups − 1) is one row of the module docstring's
    statistics. -> (codes q [rows, cols] int64 in 0..3, levels t [groups, 4] float32); a group
    with no values has levels 0. quantize_rows is the case of one group per row; SparseLoCo
    quantizes many tensors' kept values at once this way, one group per tensor."""
    rows, cols = x.shape
    if cols == 0 or rows == 0:
        return (torch.zeros(rows, cols, dtype=torch.int64, device=x.device),
                torch.zeros(groups, LEVELS, device=x.device))
    x64 = x.double()
    n = _group_sums(torch.full((rows,), float(cols), dtype=torch.float64, device=x.device), group, groups)
    mu = _group_sums(x64.sum(dim=1), group, groups) / n.clamp(min=1)            # μ  [groups]
    centred = x64 - mu[group].unsqueeze(1)                                      # x − μ  [rows, cols]
    sigma = (_group_sums(centred.square().sum(dim=1), group, groups) / (n - 1).clamp(min=1)).sqrt()   # σ, unbiased
    width = sigma * (RANGE_SIGMAS / LEVELS)                                     # s = R σ / L
    width = torch.where((width > 0) & width.isfinite(), width, torch.ones_like(width))
    # q = clamp(round((x − μ) / s + L/2), 0, L − 1); a NaN (non-finite group) codes as 0
    q = (centred / width[group].unsqueeze(1) + LEVELS // 2).round_().clamp_(0, LEVELS - 1).nan_to_num_(0.0).long()
    sums, counts = _bin_sums(q, x64, group, groups)
    # t_b = mean of the x coded b (μ for an empty level); + (μ − μ): NaN for a non-finite group
    mu = mu.unsqueeze(1)
    levels = torch.where(counts > 0, sums / counts.clamp(min=1), mu) + (mu - mu)
    return q, levels.float()


def _group_sums(per_row: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """[groups] float64: Σ of per_row [rows] over each group's rows, in row order."""
    return torch.zeros(groups, dtype=torch.float64, device=per_row.device).index_add_(0, group, per_row)


def _bin_sums(q: torch.Tensor, x64: torch.Tensor, group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of the x coded b, their count), both float64 [groups, L]. On CPU one bincount over
    group · L + q, each bin summed in row-major order, 2-3x faster than scatter_add on 115K
    values; elsewhere index_add (CUDA's bincount has no deterministic mode)."""
    bins = (q + LEVELS * group.unsqueeze(1)).view(-1)
    if q.device.type != "cpu":
        sums = torch.zeros(groups * LEVELS, dtype=torch.float64, device=q.device).index_add_(0, bins, x64.view(-1))
        counts = torch.zeros_like(sums).index_add_(0, bins, torch.ones_like(x64.view(-1)))
        return sums.view(groups, LEVELS), counts.view(groups, LEVELS)
    sums = torch.bincount(bins, weights=x64.view(-1), minlength=groups * LEVELS).view(groups, LEVELS)
    return sums, torch.bincount(bins, minlength=groups * LEVELS).view(groups, LEVELS).to(torch.float64)


class TwoBitCodec(ValueCodec):
    """'2bit': four float32 levels per row, then 2-bit codes (the module docstring)."""

    name = "2bit"

    def nbytes(self, rows: int, cols: int) -> int:
        rows, cols = _dim("rows", rows), _dim("cols", cols)
        return 4 * LEVELS * rows + packed_nbytes(rows * cols, 2)

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        q, levels = quantize_rows(x)
        head = 4 * LEVELS * x.shape[0]
        out[:head].copy_(_bytes_of(levels, torch.float32))
        pack_bits(q, 2, out=out[head:])

    def _decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        head = 4 * LEVELS * rows
        levels = _as_dtype(buf[:head], torch.float32).view(rows, LEVELS)
        q = unpack_bits(buf[head:], 2, rows * cols).view(rows, cols)
        return levels.gather(1, q)                                       # x̂ = t_q, a new tensor
