"""Value formats (`VALUE_FORMATS`, the one table of their names) and value codecs: a float
tensor [rows, cols] <-> a flat uint8 buffer whose size depends only on (rows, cols).

`rows` are groups that get one scale each (e.g. chunks), `cols` the values per group.
Every number on the wire is little-endian; values are row-major. Layouts:
    fp32  rows*cols float32                                                  lossless
    bf16  rows*cols bfloat16, round to nearest even
    fp16  rows*cols float16; finite values beyond +-65504 saturate to +-65504
    int8  rows float32 scales, then rows*cols int8
    sign  rows float32 scales, then packed_nbytes(rows*cols, 1) bytes of sign bits
    signbit  packed_nbytes(rows*cols, 1) bytes of sign bits, no scale: decoded as +1 or -1
          (Psyche's DeMo messages; a NaN codes as -1, so the sender checks finiteness first)
    2bit  rows*4 float32 levels, then packed_nbytes(rows*cols, 2) bytes of 2-bit codes
          (SparseLoCo's statistical quantizer: `thinwire.wire.twobit`)
    8bit  rows*256 float32 levels, then rows*cols bytes of codes
          (the same quantizer with 256 levels, Templar's default: `thinwire.wire.eightbit`)
Codecs accept any floating input dtype and compute in float32; decode returns float32.
A row holding NaN or inf always decodes to non-finite values (fp16 saturates only finite
values; int8 and sign rows get a non-finite scale, 2bit and 8bit rows non-finite levels), so a
receiver-side finiteness check catches it; except signbit, whose one bit per value cannot (its
sender checks its values' finiteness before it encodes).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

import torch

from .bits import pack_signs, packed_nbytes, unpack_signs
from .codec import ValueCodec, _as_dtype, _bytes_of, _dim
from .eightbit import EightBitCodec
from .twobit import TwoBitCodec

FP16_MAX = 65504.0


class ValueFormat(NamedTuple):
    """How one float value travels (an entry of `VALUE_FORMATS`)."""

    bits: int                    # wire bits per value, not counting the per-row scale
    scaled: bool                 # per-row statistics (chunk, block) precede the values
    row_floats: int              # float32 numbers of those statistics per row (0 when not scaled)
    lossless: bool               # decode(encode(x)) == x for finite x
    error_factor: float | None   # eps with (E)||Q(v) - v||^2 <= eps ||v||^2; None: no such bound
    codec: bool                  # get_codec(name) gives a [rows, cols] codec; False: only a seeded
                                 # EF21 value stage on flat vectors (thinwire.compress.value_stages)
    description: str


VALUE_FORMATS = MappingProxyType({
    "fp32": ValueFormat(32, False, 0, True, 0.0, True, "float32, lossless"),
    "bf16": ValueFormat(16, False, 0, False, 2.0 ** -16, True, "bfloat16, round to nearest even"),
    "fp16": ValueFormat(16, False, 0, False, 2.0 ** -22, True,
                        "float16; finite values saturate at +-65504 (eps holds in the normal range)"),
    "int8": ValueFormat(8, True, 1, False, None, True, "float32 absmax scale per row, then int8 values"),
    "sign": ValueFormat(1, True, 1, False, None, True, "float32 mean|x| scale per row, then 1 sign bit per value"),
    "signbit": ValueFormat(1, False, 0, False, None, True,
                           "1 sign bit per value and no scale: decoded as +1 or -1 (zero codes as +1; Psyche's)"),
    "2bit": ValueFormat(2, True, 4, False, None, True,
                        "4 float32 levels per row (SparseLoCo's statistical quantizer: the means of the values "
                        "in 4 bins 1.5 sigma wide), then a 2-bit code per value"),
    "8bit": ValueFormat(8, True, 256, False, None, True,
                        "256 float32 levels per row (Templar's statistical quantizer: the means of the values "
                        "in 256 bins 6/256 sigma wide), then a 1-byte code per value"),
    "natural": ValueFormat(9, False, 0, False, 1.0 / 8.0, False,
                           "sign bit + float32 exponent: |x| rounded stochastically (from a seed) to a "
                           "neighbouring power of two, unbiased"),
})
"""Every value format thinwire knows, by name: the one table the other name lists derive from."""

CODEC_NAMES: tuple[str, ...] = tuple(name for name, fmt in VALUE_FORMATS.items() if fmt.codec)
"""The formats `get_codec` provides ([rows, cols] codecs): every format but 'natural'."""


class FloatCodec(ValueCodec):
    """Each value in a float dtype: rows*cols*itemsize bytes, row-major, little-endian.

    fp32 (torch.float32): the values' own bytes, lossless.
    bf16 (torch.bfloat16): float32 -> bfloat16 rounded to nearest even.
    fp16 (torch.float16): finite values are clamped to [-65504, 65504] first, so they
    saturate instead of overflowing to inf; +-inf and NaN pass through unchanged, so a
    non-finite value is never disguised as a finite one.
    """

    NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

    def __init__(self, dtype: torch.dtype):
        if dtype not in self.NAMES:
            raise ValueError(f"dtype must be one of {tuple(self.NAMES)}, got {dtype}")
        self.dtype, self.name = dtype, self.NAMES[dtype]
        self.lossless = VALUE_FORMATS[self.name].lossless

    def nbytes(self, rows: int, cols: int) -> int:
        return _dim("rows", rows) * _dim("cols", cols) * self.dtype.itemsize

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.dtype == torch.float16:
            x = torch.where(x.isinf(), x, x.clamp(-FP16_MAX, FP16_MAX))
        out.copy_(_bytes_of(x, self.dtype))

    def _decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        # to(..., copy=True): a fp32 result must not alias the caller's receive buffer
        return _as_dtype(buf, self.dtype).view(rows, cols).to(torch.float32, copy=True)


class Int8Codec(ValueCodec):
    """Symmetric int8 with one float32 scale per row.

    Layout: [rows float32 scales s][rows*cols int8 q], row-major.
    s = max |x| over the row; q = round(x / s * 127) (round half to even), within [-127, 127];
    decoded value q * s / 127, so each error is at most s / 254 (half a step). A row of
    zeros (or with no columns) has s = 0 and decodes to zeros. A row holding NaN or inf
    gets a non-finite s, so it decodes non-finite.
    """

    name = "int8"

    def nbytes(self, rows: int, cols: int) -> int:
        rows, cols = _dim("rows", rows), _dim("cols", cols)
        return 4 * rows + rows * cols

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows, cols = x.shape
        scale = x.abs().amax(dim=1, keepdim=True) if cols else x.new_zeros(rows, 1)
        # x / s (not x * (127 / s)): 127 / s overflows to inf for subnormal s
        q = (x / torch.where(scale > 0, scale, 1.0)).mul_(127).round_().clamp_(-127, 127)
        q.nan_to_num_(0.0)  # NaN -> int8 is undefined; the row's NaN scale already marks it
        out[: 4 * rows].copy_(_bytes_of(scale, torch.float32))
        out[4 * rows:].copy_(_bytes_of(q, torch.int8))

    def _decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        scale = _as_dtype(buf[: 4 * rows], torch.float32).view(rows, 1)
        q = buf[4 * rows:].view(torch.int8).view(rows, cols)
        return q.float().mul_(scale).div_(127)


class SignCodec(ValueCodec):
    """One bit per value plus one float32 scale per row.

    Layout: [rows float32 scales s][packed_nbytes(rows*cols, 1) bytes of signs, `pack_signs`
    of the row-major values: bit 1 for x >= 0 (zero codes as +), 0 for x < 0 or NaN].
    Decoded value: +s or -s. scale='mean_abs' (default): s = mean |x| of the row, the s that
    minimises ||x - s*sign(x)||. scale='rms': s = sqrt(mean x^2), which keeps each row's
    L2 norm (the scale 1-bit Adam uses). A row with no columns has s = 0.
    A row holding NaN or inf gets a non-finite s, so it decodes non-finite.
    """

    name = "sign"
    SCALES = ("mean_abs", "rms")

    def __init__(self, scale: str = "mean_abs"):
        if scale not in self.SCALES:
            raise ValueError(f"scale must be one of {self.SCALES}, got {scale!r}")
        self.scale = scale

    def nbytes(self, rows: int, cols: int) -> int:
        rows, cols = _dim("rows", rows), _dim("cols", cols)
        return 4 * rows + packed_nbytes(rows * cols, 1)

    def row_scale(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 scale of each row of x [rows, cols] -> [rows]."""
        x = x.float()
        if x.shape[1] == 0:
            return x.new_zeros(x.shape[0])
        if self.scale == "mean_abs":
            return x.abs().mean(dim=1)
        # sqrt(mean x^2) taken relative to the row's absmax: x^2 itself would overflow to inf
        # above ~1.8e19 and underflow to 0 below ~1e-23
        peak = x.abs().amax(dim=1, keepdim=True)
        rel = x / torch.where(peak > 0, peak, 1.0)
        return rel.square_().mean(dim=1).sqrt_().mul_(peak.squeeze(1))

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows = x.shape[0]
        out[: 4 * rows].copy_(_bytes_of(self.row_scale(x), torch.float32))
        pack_signs(x, out=out[4 * rows:])

    def _decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        scale = _as_dtype(buf[: 4 * rows], torch.float32).view(rows, 1)
        return unpack_signs(buf[4 * rows:], rows * cols).view(rows, cols).mul_(scale)

    def __repr__(self) -> str:
        return f"SignCodec(scale={self.scale!r})"


class SignBitCodec(ValueCodec):
    """One bit per value and nothing else: `pack_signs` of the row-major values (bit 1 for
    x >= 0, so zero codes as +1; 0 for x < 0 or NaN), decoded as +1.0 or -1.0. The magnitude
    stays with the sender: only an algorithm that keeps it there (`thinwire.SignDeMo`) or
    needs none can use it, and a non-finite value cannot be told from -1 on the wire."""

    name = "signbit"

    def nbytes(self, rows: int, cols: int) -> int:
        return packed_nbytes(_dim("rows", rows) * _dim("cols", cols), 1)

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        pack_signs(x, out=out)

    def _decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return unpack_signs(buf, rows * cols).view(rows, cols)


def get_codec(name: str) -> ValueCodec:
    """A new codec for the wire precision `name`, one of CODEC_NAMES ('sign' uses mean_abs)."""
    if name == "fp32":
        return FloatCodec(torch.float32)
    if name == "bf16":
        return FloatCodec(torch.bfloat16)
    if name == "fp16":
        return FloatCodec(torch.float16)
    if name == "int8":
        return Int8Codec()
    if name == "sign":
        return SignCodec()
    if name == "signbit":
        return SignBitCodec()
    if name == "2bit":
        return TwoBitCodec()
    if name == "8bit":
        return EightBitCodec()
    raise ValueError(f"values must be one of {', '.join(map(repr, CODEC_NAMES))}, got {name!r}")
