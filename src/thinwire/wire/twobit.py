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
from .codec import ValueCodec, _as_dtype, _bytes_of, _dim

LEVELS = 4              # 2 bits
RANGE_SIGMAS = 6.0      # the reference's quantization_range


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (codes q [rows, cols] int64 in 0..3, levels t [rows, 4] float32)."""
    rows, cols = x.shape
    if cols == 0:
        return torch.zeros(rows, 0, dtype=torch.int64, device=x.device), torch.zeros(rows, LEVELS, device=x.device)
    x64 = x.double()
    mu = x64.mean(dim=1, keepdim=True)                                   # μ  [rows, 1]
    centred = x64 - mu                                                   # x − μ
    sigma = (centred.square().sum(dim=1, keepdim=True) / max(cols - 1, 1)).sqrt()   # σ, unbiased (0 if n = 1)
    width = sigma * (RANGE_SIGMAS / LEVELS)                              # s = R σ / L
    width = torch.where((width > 0) & width.isfinite(), width, torch.ones_like(width))
    # q = clamp(round((x − μ) / s + L/2), 0, L − 1); a NaN (non-finite row) codes as 0
    q = (centred / width + LEVELS // 2).round_().clamp_(0, LEVELS - 1).nan_to_num_(0.0).long()
    sums, counts = _bin_sums(q, x64)
    # t_b = mean of the x coded b (μ for an empty level); + (μ − μ): NaN for a non-finite row
    levels = torch.where(counts > 0, sums / counts.clamp(min=1), mu) + (mu - mu)
    return q, levels.float()


def quantize_segments(x: torch.Tensor, segment: "Segments") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of rows of different lengths laid end to end: x [n] (any float dtype),
    `segment` their layout (`Segments`) -> (codes q [n] int64, levels t [rows, 4] float32),
    with no host read.

    The same formulas; each row's Σ x and Σ (x − μ)² is a segment sum in element order
    (`torch.segment_reduce`: sequential on CPU, one deterministic segmented reduction on a
    GPU) where `quantize_rows` sums a row with torch's cascaded sum. The Σ x of float32
    values in float64 is exact (hence the same μ) unless a row's values span more than
    2^(29 − log2 n) in magnitude; Σ (x − μ)² may differ in its last float64 bit, which moves
    a code only for a value within about 1e-16 (relative) of a bin edge."""
    x64 = x.double()
    # μ = Σ x / n   [rows]
    mu = torch.segment_reduce(x64, "sum", lengths=segment.lengths, unsafe=True).div_(segment.n)
    centred = x64 - mu.index_select(0, segment.row)                              # x − μ  [n]
    # σ = sqrt(Σ (x − μ)² / max(n − 1, 1))   [rows]
    sigma = torch.segment_reduce(centred.square(), "sum", lengths=segment.lengths, unsafe=True)
    sigma = sigma.div_(segment.dof).sqrt_()
    width = sigma * (RANGE_SIGMAS / LEVELS)                                      # s = R σ / L
    # s = 1 where it is not > 0 or not finite (NaN fails both comparisons, as isfinite would)
    width = torch.where((width > 0) & (width < float("inf")), width, 1.0)
    # q = clamp(round((x − μ) / s + L/2), 0, L − 1); a NaN (non-finite row) codes as 0
    q = (centred / width.index_select(0, segment.row) + LEVELS // 2).round_().clamp_(0, LEVELS - 1).nan_to_num_(0.0).long()
    sums, counts = _segment_bin_sums(q, x64, segment)
    mu = mu.unsqueeze(1)                                                         # [rows, 1]
    # t_b = mean of the x coded b (μ for an empty level; an int64 count divides as float64);
    # + (μ − μ): NaN for a non-finite row
    levels = torch.where(counts > 0, sums / counts.clamp(min=1), mu) + (mu - mu)
    # row-major: the masked sums (a GPU's) come as transposed views, and callers view t flat
    return q, levels.to(torch.float32, memory_format=torch.contiguous_format)


class Segments:
    """Rows of `lengths` values (each >= 1) laid end to end, on `device`: each value's row
    (`row`, `level_of` = 4 · row: where its levels start in the flat [rows, 4] levels) and the
    rows' counts as `quantize_segments` divides by them, made once."""

    def __init__(self, lengths: list[int], device):
        counts = torch.tensor(lengths, dtype=torch.int64)
        self.rows = len(lengths)
        self.lengths = counts.to(device)
        self.row = torch.repeat_interleave(torch.arange(self.rows), counts).to(device)   # [n]
        self.level_of = self.row * LEVELS
        self.n = counts.double().to(device)                                     # n
        self.dof = counts.sub(1).clamp_(min=1).double().to(device)              # max(n − 1, 1)


def _segment_bin_sums(q: torch.Tensor, x64: torch.Tensor, segment: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of each row's x coded b float64, their count), [rows, L], each in element
    order: on CPU one bincount over 4 · row + q (as `_bin_sums`); elsewhere
    `_masked_segment_bin_sums` (no atomics: the same bits on every run)."""
    rows = segment.rows
    if q.device.type != "cpu":
        return _masked_segment_bin_sums(q, x64, segment)
    bins = q + segment.level_of                                                  # 4 · row + q  [n]
    sums = torch.bincount(bins, weights=x64, minlength=rows * LEVELS).view(rows, LEVELS)
    return sums, torch.bincount(bins, minlength=rows * LEVELS).view(rows, LEVELS)


def _masked_segment_bin_sums(q: torch.Tensor, x64: torch.Tensor, segment: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """`_segment_bin_sums` as a masked [L, n] image summed by segment, level-major so that each
    (level, row) is one segment of a 1-D `segment_reduce`: on a GPU that is one deterministic
    segmented reduction, where a 2-D [n, L] one runs one thread per (row, level) along the row
    (300 ms a sync on an H200 at GPT-2 small, rows of up to 1M values)."""
    hit = torch.arange(LEVELS, device=q.device).unsqueeze(1) == q                 # [L, n]
    lengths = segment.lengths.repeat(LEVELS)                                     # [L · rows]: level-major
    sums = torch.segment_reduce(torch.where(hit, x64, 0.0).view(-1), "sum", lengths=lengths, unsafe=True)
    counts = torch.segment_reduce(hit.view(-1).double(), "sum", lengths=lengths, unsafe=True)
    # [L · rows] -> [L, rows] -> [rows, L]
    return sums.view(LEVELS, segment.rows).t(), counts.view(LEVELS, segment.rows).t()


def _bin_sums(q: torch.Tensor, x64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of the x coded b, their count), both float64 [rows, L]. On CPU one bincount over
    row · L + q, each bin summed in column order as a scatter_add along the row would (the
    same float64 sums), 2-3x faster on 115K values; elsewhere `_masked_bin_sums`."""
    rows = q.shape[0]
    if q.device.type != "cpu":
        return _masked_bin_sums(q, x64)
    bins = (q + LEVELS * torch.arange(rows).unsqueeze(1)).view(-1)
    sums = torch.bincount(bins, weights=x64.view(-1), minlength=rows * LEVELS).view(rows, LEVELS)
    return sums, torch.bincount(bins, minlength=rows * LEVELS).view(rows, LEVELS).to(torch.float64)


def _masked_bin_sums(q: torch.Tensor, x64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_bin_sums` as one masked reduction per level: deterministic on a GPU, where scatter_add_
    and bincount add in the order their atomics land (the levels, and so the bytes, of a
    resumed run could differ in the last bit), and 4 bins of one row of ~40K values are
    contended atomics (67 µs a tensor on an H200 at GPT-2 small, 10 ms a round)."""
    hit = q.unsqueeze(-1) == torch.arange(LEVELS, device=q.device)            # [rows, cols, L]
    sums = torch.where(hit, x64.unsqueeze(-1), 0.0).sum(dim=1)                 # [rows, L]
    return sums, hit.sum(dim=1, dtype=torch.float64)


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
