"""SparseLoCo's compressor (Sarfi et al., arXiv 2508.15706): `ChunkedTopK` with the paper's two
choices, on any tensor.

    k per chunk    k = max(1, round(E · topk / chunk²)) for a chunk of E elements (at most E):
                   the density topk / chunk² on every chunk, the smaller chunks of a dimension
                   shorter than `chunk` included (SparseLoCo's reference scales k the same
                   way, Python's round, half to even); a full chunk × chunk chunk keeps topk
    values '2bit'  the kept values of the whole tensor are one row of the '2bit' codec
                   (`thinwire.wire.twobit`): one set of 4 levels per tensor, as the reference
                   quantizes each tensor's values together; '8bit' the same with 256 levels
                   (`thinwire.wire.eightbit`, Templar's default). Other formats keep
                   ChunkedTopK's rows, one per chunk (one scale per chunk for int8).

Wire format of one tensor of C chunks of E elements each: the C·k chunk-local indices in
ceil(log2 E) bits each, bit-packed (indices='elias-fano': each chunk's ascending, in
ceil(C·k·L / 8) + ceil(C·(k + ((E − 1) >> L) + 1) / 8) bytes, L = floor(log2(E / k)),
`thinwire.wire.indices`), then the values, in the indices' order:
    2bit  16 + ceil(C·k / 4) bytes     8bit  1024 + C·k     int8  4·C + C·k     bf16  2·C·k     fp32  4·C·k

`encode_sent` is `encode` that also returns what every receiver will decode from the bytes,
for the sender's error feedback. With the identity transform that is sparse: the C·k values
decoded from this rank's own value bytes at their flat positions in the tensor (padding
dropped), so e' = e − Δ̂ touches C·k elements instead of decoding a dense tensor.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import torch

from .chunking import ChunkPlan
from .payload import check_buffer
from .topk import ChunkedTopK, Read

SPARSE_TRANSFORMS = ("identity", "dct")           # top-k on the values themselves (the paper's default) or on DCT-II
SPARSE_VALUES = ("2bit", "8bit", "int8", "bf16", "fp32")
PER_TENSOR_VALUES = ("2bit", "8bit")              # statistical quantizers: one row (one set of levels) per tensor


class Sent(NamedTuple):
    """One rank's message for one tensor as every receiver decodes it (`encode_sent`)."""
    positions: torch.Tensor | None     # [n] int64 flat positions in the tensor; None: `values` is dense
    values: torch.Tensor               # [n] float32 decoded values (or the dense decoded tensor)
    read: Read | None                  # what `read()` of these bytes returns; None for 'dct'


class OneRow:
    """A value codec applied to all values of a [rows, cols] tensor as a single row (a
    `StatisticalCodec`: its `levels` per row and `bits` per code shown through)."""

    def __init__(self, codec):
        self.codec, self.name, self.lossless = codec, codec.name, codec.lossless
        self.levels, self.bits = codec.levels, codec.bits

    def nbytes(self, rows: int, cols: int) -> int:
        return self.codec.nbytes(1, rows * cols)

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.encode(x.reshape(1, -1), out=out)

    def decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return self.codec.decode(buf, 1, rows * cols).view(rows, cols)


class SparseLoCoTopK(ChunkedTopK):
    """Top-k per chunk at a fixed density, the values quantized per tensor (module docstring).
    `topk` is k for a full chunk × chunk chunk, 1 <= topk <= chunk²."""

    def __init__(self, topk: int = 128, chunk: int = 64, transform: str = "identity", values: str = "2bit",
                 indices: str = "packed"):
        if transform not in SPARSE_TRANSFORMS:
            raise ValueError(f"transform must be one of {SPARSE_TRANSFORMS}, got {transform!r}")
        if values not in SPARSE_VALUES:
            raise ValueError(f"values must be one of {SPARSE_VALUES}, got {values!r}")
        super().__init__(topk, chunk, transform, values, indices=indices)
        if self.topk > self.chunk ** 2:
            raise ValueError(f"topk must be at most chunk**2 = {self.chunk ** 2} (every element), got {topk}")
        if values in PER_TENSOR_VALUES:
            self.codec = OneRow(self.codec)
        self._buffer: torch.Tensor | None = None                     # `scratch`, grown as needed

    def encode_sent(self, x: torch.Tensor, out: torch.Tensor, step: int = 0) -> Sent:
        """encode(x, out, step) (x float32, contiguous), and what receivers decode from `out`:
        for 'identity' the values at their flat positions in x (n = C·k less the padding's) and
        the (indices, values) `read()` returns; for 'dct' the dense decoded tensor."""
        if self.transform.kind != "identity":
            self.encode(x, out, step)
            return Sent(None, self.decode(out, x.shape, step), None)
        plan = self.plan(x.shape)
        scratch = self.scratch(2 * plan.padded_numel, x.device)
        image = plan.padded_matrix(x, scratch[plan.padded_numel:])     # [R, C], x itself when unpadded
        idx, positions, values = self.select_at(image, x.shape, scratch)
        payload = self.write((idx, values), x.shape, check_buffer(out, self.payload_nbytes(x.shape)))
        sent = self.codec.decode(payload.parts["values"], plan.num_chunks, idx.shape[1])   # [C, k], as read() does
        return Sent(*_unpadded(plan, positions.view(-1), sent.view(-1)), (idx, sent))

    def scratch(self, numel: int, device) -> torch.Tensor:
        """A flat float32 buffer of at least `numel` elements, reused across calls."""
        if self._buffer is None or self._buffer.numel() < numel or self._buffer.device != torch.device(device):
            self._buffer = torch.empty(numel, dtype=torch.float32, device=device)
        return self._buffer

    def k(self, shape) -> int:
        elems = self.plan(shape).chunk_elems
        # k = max(1, round(E · topk / chunk²)), at most E (exact: a Fraction rounds half to even)
        return min(elems, max(1, round(Fraction(elems * self.topk, self.chunk ** 2))))


def _unpadded(plan: ChunkPlan, image_positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in the padded image [R, C] -> flat positions in the tensor [rows, cols]; the
    values kept in the padding (which receivers crop away) dropped."""
    if not plan.padded:
        return image_positions, values
    r = torch.div(image_positions, plan.padded_cols, rounding_mode="floor")
    c = image_positions - r * plan.padded_cols
    inside = (r < plan.rows) & (c < plan.cols)
    return (r * plan.cols + c)[inside], values[inside]
