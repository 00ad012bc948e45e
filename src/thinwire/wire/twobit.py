"""The '2bit' value format: SparseLoCo's statistical quantizer (Sarfi et al., arXiv 2508.15706),
4 levels per row, each level the mean of the values coded with it; and that quantizer for any
number of levels L (`quantize_rows`, `quantize_segments`, `StatisticalCodec`): '8bit' is the
same with L = 256 (`thinwire.wire.eightbit`, Templar's default).

For one row of n values x (any float dtype; statistics in float64), L = 4 here:

    μ = mean(x)                                   the row's centre
    σ = sqrt(Σ (x − μ)² / (n − 1))                its unbiased deviation (0 when n <= 1)
    s = R σ / L                                   bin width: R = 6 sigmas over L levels;
                                                  s = 1 where that is 0 or not finite
    q = clamp(round((x − μ) / s + L/2), 0, L−1)   the code (round half to even), 2 bits
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
MASKED_MAX_LEVELS = 4   # off CPU, bin sums as masked reductions up to this many levels, else sorted


def quantize_rows(x: torch.Tensor, levels: int = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (codes q [rows, cols] int64 in 0..L−1, levels t [rows, L] float32),
    L = `levels`."""
    rows, cols = x.shape
    L = levels
    if cols == 0:
        return torch.zeros(rows, 0, dtype=torch.int64, device=x.device), torch.zeros(rows, L, device=x.device)
    x64 = x.double()
    mu = x64.mean(dim=1, keepdim=True)                                   # μ  [rows, 1]
    centred = x64 - mu                                                   # x − μ
    sigma = (centred.square().sum(dim=1, keepdim=True) / max(cols - 1, 1)).sqrt()   # σ, unbiased (0 if n = 1)
    width = sigma * (RANGE_SIGMAS / L)                                   # s = R σ / L
    width = torch.where((width > 0) & width.isfinite(), width, torch.ones_like(width))
    # q = clamp(round((x − μ) / s + L/2), 0, L − 1); a NaN (non-finite row) codes as 0
    q = (centred / width + L // 2).round_().clamp_(0, L - 1).nan_to_num_(0.0).long()
    sums, counts = _bin_sums(q, x64, L)
    # t_b = mean of the x coded b (μ for an empty level); + (μ − μ): NaN for a non-finite row
    levels = torch.where(counts > 0, sums / counts.clamp(min=1), mu) + (mu - mu)
    return q, levels.float()


def quantize_segments(x: torch.Tensor, segment: "Segments") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of rows of different lengths laid end to end: x [n] (any float dtype),
    `segment` their layout (`Segments`, which fixes L) -> (codes q [n] int64, levels t
    [rows, L] float32), with no host read.

    The same formulas; each row's Σ x and Σ (x − μ)² is a segment sum in element order
    (`torch.segment_reduce`: sequential on CPU, one deterministic segmented reduction on a
    GPU) where `quantize_rows` sums a row with torch's cascaded sum. The Σ x of float32
    values in float64 is exact (hence the same μ) unless a row's values span more than
    2^(29 − log2 n) in magnitude; Σ (x − μ)² may differ in its last float64 bit, which moves
    a code only for a value within about 1e-16 (relative) of a bin edge."""
    x64, L = x.double(), segment.levels
    # μ = Σ x / n   [rows]
    mu = torch.segment_reduce(x64, "sum", lengths=segment.lengths, unsafe=True).div_(segment.n)
    centred = x64 - mu.index_select(0, segment.row)                              # x − μ  [n]
    # σ = sqrt(Σ (x − μ)² / max(n − 1, 1))   [rows]
    sigma = torch.segment_reduce(centred.square(), "sum", lengths=segment.lengths, unsafe=True)
    sigma = sigma.div_(segment.dof).sqrt_()
    width = sigma * (RANGE_SIGMAS / L)                                           # s = R σ / L
    # s = 1 where it is not > 0 or not finite (NaN fails both comparisons, as isfinite would)
    width = torch.where((width > 0) & (width < float("inf")), width, 1.0)
    # q = clamp(round((x − μ) / s + L/2), 0, L − 1); a NaN (non-finite row) codes as 0
    q = (centred / width.index_select(0, segment.row) + L // 2).round_().clamp_(0, L - 1).nan_to_num_(0.0).long()
    sums, counts = _segment_bin_sums(q, x64, segment)
    mu = mu.unsqueeze(1)                                                         # [rows, 1]
    # t_b = mean of the x coded b (μ for an empty level; an int64 count divides as float64);
    # + (μ − μ): NaN for a non-finite row
    levels = torch.where(counts > 0, sums / counts.clamp(min=1), mu) + (mu - mu)
    # row-major: the masked sums (a GPU's) come as transposed views, and callers view t flat
    return q, levels.to(torch.float32, memory_format=torch.contiguous_format)


class Segments:
    """Rows of `lengths` values (each >= 1) laid end to end, on `device`, quantized to `levels`
    levels L each: each value's row (`row`, `level_of` = L · row: where its levels start in the
    flat [rows, L] levels) and the rows' counts as `quantize_segments` divides by them, made once."""

    def __init__(self, lengths: list[int], device, levels: int = LEVELS):
        counts = torch.tensor(lengths, dtype=torch.int64)
        self.rows, self.levels = len(lengths), levels
        self.lengths = counts.to(device)
        self.row = torch.repeat_interleave(torch.arange(self.rows), counts).to(device)   # [n]
        self.level_of = self.row * levels
        self.n = counts.double().to(device)                                     # n
        self.dof = counts.sub(1).clamp_(min=1).double().to(device)              # max(n − 1, 1)


def _segment_bin_sums(q: torch.Tensor, x64: torch.Tensor, segment: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of each row's x coded b float64, their count), [rows, L], each in element
    order: on CPU one bincount over L · row + q (as `_bin_sums`); elsewhere
    `_masked_segment_bin_sums` up to 4 levels, `_sorted_bin_sums` above (no atomics on
    floats: the same bits on every run)."""
    rows, L = segment.rows, segment.levels
    if q.device.type != "cpu" and L <= MASKED_MAX_LEVELS:
        return _masked_segment_bin_sums(q, x64, segment)
    bins = q + segment.level_of                                                  # L · row + q  [n]
    if q.device.type != "cpu":
        return _sorted_bin_sums(bins, x64, rows, L)
    sums = torch.bincount(bins, weights=x64, minlength=rows * L).view(rows, L)
    return sums, torch.bincount(bins, minlength=rows * L).view(rows, L)


def _masked_segment_bin_sums(q: torch.Tensor, x64: torch.Tensor, segment: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """`_segment_bin_sums` as a masked [L, n] image summed by segment, level-major so that each
    (level, row) is one segment of a 1-D `segment_reduce`: on a GPU that is one deterministic
    segmented reduction, where a 2-D [n, L] one runs one thread per (row, level) along the row
    (300 ms a sync on an H200 at GPT-2 small, rows of up to 1M values)."""
    L = segment.levels
    hit = torch.arange(L, device=q.device).unsqueeze(1) == q                      # [L, n]
    lengths = segment.lengths.repeat(L)                                          # [L · rows]: level-major
    sums = torch.segment_reduce(torch.where(hit, x64, 0.0).view(-1), "sum", lengths=lengths, unsafe=True)
    counts = torch.segment_reduce(hit.view(-1).double(), "sum", lengths=lengths, unsafe=True)
    # [L · rows] -> [L, rows] -> [rows, L]
    return sums.view(L, segment.rows).t(), counts.view(L, segment.rows).t()


def _bin_sums(q: torch.Tensor, x64: torch.Tensor, levels: int = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of the x coded b, their count), both float64 [rows, L]. On CPU one bincount over
    row · L + q, each bin summed in column order as a scatter_add along the row would (the
    same float64 sums), 2-3x faster on 115K values; elsewhere `_masked_bin_sums` up to 4
    levels, `_sorted_bin_sums` above."""
    rows, L = q.shape[0], levels
    if q.device.type != "cpu" and L <= MASKED_MAX_LEVELS:
        return _masked_bin_sums(q, x64, L)
    bins = (q + L * torch.arange(rows, device=q.device).unsqueeze(1)).view(-1)       # L · row + q  [rows · cols]
    if q.device.type != "cpu":
        sums, counts = _sorted_bin_sums(bins, x64.view(-1), rows, L)
    else:
        sums = torch.bincount(bins, weights=x64.view(-1), minlength=rows * L).view(rows, L)
        counts = torch.bincount(bins, minlength=rows * L).view(rows, L)
    return sums, counts.to(torch.float64)


def _sorted_bin_sums(bins: torch.Tensor, x64: torch.Tensor, rows: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of the x in each bin float64, their count int64), [rows, L], from each value's bin
    L · row + q [n]: a stable sort by bin, then one segmented sum, so each bin sums in element
    order as bincount does on CPU, with no float atomics (deterministic on a GPU) and no
    [n, L] mask (8 GiB of float64 at L = 256 over 4M kept values). The counts are integers."""
    counts = torch.bincount(bins, minlength=rows * levels)                       # [rows · L]
    order = torch.sort(bins, stable=True).indices                                # element order within a bin
    sums = torch.segment_reduce(x64.index_select(0, order), "sum", lengths=counts, unsafe=True)
    return sums.view(rows, levels), counts.view(rows, levels)


def _masked_bin_sums(q: torch.Tensor, x64: torch.Tensor, levels: int = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """`_bin_sums` as one masked reduction per level: deterministic on a GPU, where scatter_add_
    and bincount add in the order their atomics land (the levels, and so the bytes, of a
    resumed run could differ in the last bit), and 4 bins of one row of ~40K values are
    contended atomics (67 µs a tensor on an H200 at GPT-2 small, 10 ms a round)."""
    hit = q.unsqueeze(-1) == torch.arange(levels, device=q.device)            # [rows, cols, L]
    sums = torch.where(hit, x64.unsqueeze(-1), 0.0).sum(dim=1)                 # [rows, L]
    return sums, hit.sum(dim=1, dtype=torch.float64)


class StatisticalCodec(ValueCodec):
    """The statistical quantizer with `levels` = 2^`bits` levels per row: rows × L float32
    levels t (row-major), then packed_nbytes(rows·cols, bits) bytes of codes,
    `pack_bits(q, bits)` of the row-major codes (the module docstring, L levels)."""

    name, levels, bits = "", LEVELS, 2

    def nbytes(self, rows: int, cols: int) -> int:
        rows, cols = _dim("rows", rows), _dim("cols", cols)
        return 4 * self.levels * rows + packed_nbytes(rows * cols, self.bits)

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        q, levels = quantize_rows(x, self.levels)
        head = 4 * self.levels * x.shape[0]
        out[:head].copy_(_bytes_of(levels, torch.float32))
        pack_bits(q, self.bits, out=out[head:])

    def _decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        head = 4 * self.levels * rows
        levels = _as_dtype(buf[:head], torch.float32).view(rows, self.levels)
        q = unpack_bits(buf[head:], self.bits, rows * cols).view(rows, cols)
        return levels.gather(1, q)                                       # x̂ = t_q, a new tensor


class TwoBitCodec(StatisticalCodec):
    """'2bit': four float32 levels per row, then 2-bit codes (the module docstring)."""

    name, levels, bits = "2bit", LEVELS, 2
