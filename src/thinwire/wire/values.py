"""Value codecs: a float tensor [rows, cols] <-> a flat uint8 buffer.

`rows` are groups that get one scale each (e.g. chunks), `cols` the values per group.
Layouts (little-endian):
    fp32  rows*cols float32                           lossless
    bf16  rows*cols bfloat16 (round to nearest even)
    fp16  rows*cols float16, clamped to +-65504 first (saturates instead of becoming inf)
    int8  rows float32 scales s = max|x| of the row, then rows*cols int8 q = round(127 x / s);
          decoded q * s / 127. An all-zero row has s = 0 and decodes to zeros.
    sign  rows float32 scales, then rows*cols sign bits (`pack_signs`, zero codes as +);
          decoded sign * s. s = mean|x| of the row (the L2-optimal scale of a sign code), or
          sqrt(mean x^2) with SignCodec(scale='rms'), which keeps the row's L2 norm (1-bit Adam).
"""

from __future__ import annotations

import torch

from .bits import pack_signs, packed_nbytes, unpack_signs

FP16_MAX = 65504.0


def _view_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Read bytes as `dtype`; a slice at an unaligned offset is copied first (views need alignment)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if buf.storage_offset() % itemsize:
        buf = buf.clone()
    return buf.view(dtype)


def _bytes_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The little-endian bytes of x cast to `dtype`, flat."""
    return x.to(dtype).contiguous().view(torch.uint8).reshape(-1)


def _check_x(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"values must be a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    return x.float()


class ValueCodec:
    """Base codec: subclasses define `nbytes`, `_encode` and `decode`."""

    name = ""
    lossless = False

    def nbytes(self, rows: int, cols: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = _check_x(x)
        n = self.nbytes(*x.shape)
        if out is None:
            out = torch.empty(n, dtype=torch.uint8, device=x.device)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != n:
            raise ValueError(f"out must be a 1-D uint8 tensor of {n} bytes, got {out.dtype} {tuple(out.shape)}")
        self._encode(x, out)
        return out

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 values a receiver decodes from encode(x)."""
        return self.decode(self.encode(x), *x.shape)

    def _check_buf(self, buf: torch.Tensor, rows: int, cols: int) -> None:
        n = self.nbytes(rows, cols)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != n:
            raise ValueError(f"malformed {self.name} values: expected {n} bytes for [{rows}, {cols}], "
                             f"got a {buf.dtype} tensor of shape {tuple(buf.shape)}")


class FloatCodec(ValueCodec):
    """Values in a float dtype, rows*cols*itemsize bytes."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.lossless = dtype == torch.float32
        self.itemsize = torch.tensor([], dtype=dtype).element_size()

    def nbytes(self, rows: int, cols: int) -> int:
        return rows * cols * self.itemsize

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.dtype == torch.float16:
            x = x.clamp(-FP16_MAX, FP16_MAX)
        out.copy_(_bytes_of(x, self.dtype))

    def decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        self._check_buf(buf, rows, cols)
        return _view_as(buf, self.dtype).view(rows, cols).float()


class Int8Codec(ValueCodec):
    """Symmetric int8 with one absmax float32 scale per row."""

    name = "int8"

    def nbytes(self, rows: int, cols: int) -> int:
        return 4 * rows + rows * cols

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows = x.shape[0]
        scale = x.abs().amax(dim=1, keepdim=True)                          # [rows, 1]
        q = (x * (127.0 / scale.clamp(min=torch.finfo(torch.float32).tiny))).round_().clamp_(-127, 127)
        out[: 4 * rows].copy_(_bytes_of(scale, torch.float32))
        out[4 * rows:].copy_(_bytes_of(q, torch.int8))

    def decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        self._check_buf(buf, rows, cols)
        scale = _view_as(buf[: 4 * rows], torch.float32).view(rows, 1)
        return buf[4 * rows:].view(torch.int8).view(rows, cols).float() * (scale / 127.0)


class SignCodec(ValueCodec):
    """1 bit per value plus one float32 scale per row ('mean_abs' or 'rms')."""

    name = "sign"
    SCALES = ("mean_abs", "rms")

    def __init__(self, scale: str = "mean_abs"):
        if scale not in self.SCALES:
            raise ValueError(f"scale must be one of {self.SCALES}, got {scale!r}")
        self.scale = scale

    def nbytes(self, rows: int, cols: int) -> int:
        return 4 * rows + packed_nbytes(rows * cols, 1)

    def row_scale(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().mean(dim=1) if self.scale == "mean_abs" else x.square().mean(dim=1).sqrt()

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows = x.shape[0]
        out[: 4 * rows].copy_(_bytes_of(self.row_scale(x), torch.float32))
        pack_signs(x, out=out[4 * rows:])

    def decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        self._check_buf(buf, rows, cols)
        scale = _view_as(buf[: 4 * rows], torch.float32).view(rows, 1)
        return unpack_signs(buf[4 * rows:], rows * cols).view(rows, cols) * scale


CODEC_NAMES = ("fp32", "bf16", "fp16", "int8", "sign")


def get_codec(name: str) -> ValueCodec:
    """The codec called `name` (see CODEC_NAMES)."""
    codecs = {"fp32": lambda: FloatCodec("fp32", torch.float32), "bf16": lambda: FloatCodec("bf16", torch.bfloat16),
              "fp16": lambda: FloatCodec("fp16", torch.float16), "int8": Int8Codec, "sign": SignCodec}
    if name not in codecs:
        raise ValueError(f"values must be one of {CODEC_NAMES}, got {name!r}")
    return codecs[name]()
