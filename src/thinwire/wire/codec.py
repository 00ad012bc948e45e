"""The base of thinwire's value codecs (`ValueCodec`: a float tensor [rows, cols] <-> a flat
uint8 buffer whose size depends only on (rows, cols)) and the byte helpers they share.

Below every codec module, so the imports run one way: `twobit` (the statistical quantizer),
`eightbit` (the same with 256 levels, on `twobit`) and `values` (the table of formats, the
float, int8 and sign codecs and `get_codec`, which imports both) build on it.
"""

from __future__ import annotations

import operator

import torch


def _dim(name: str, value) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _as_dtype(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Read bytes as `dtype`. Views need the offset aligned to the item size, so a slice at
    an unaligned offset (common inside a packed message) is copied first."""
    if buf.storage_offset() % dtype.itemsize:
        buf = buf.clone()
    return buf.view(dtype)


def _bytes_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The little-endian bytes of x cast to `dtype`, flat."""
    return x.to(dtype).contiguous().view(torch.uint8).reshape(-1)


class ValueCodec:
    """A stateless codec. Subclasses define `name`, `lossless`, `nbytes`, `_encode`, `_decode`."""

    name: str = ""
    lossless: bool = False

    def nbytes(self, rows: int, cols: int) -> int:
        """Size in bytes of the encoding of a [rows, cols] tensor."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: floating [rows, cols] -> 1-D uint8 of nbytes(rows, cols), written into `out`
        (a contiguous 1-D uint8 tensor of exactly that size) when given."""
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() != 2:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a floating [rows, cols] tensor, got {got}")
        n = self.nbytes(*x.shape)
        if out is None:
            out = torch.empty(n, dtype=torch.uint8, device=x.device)
        elif (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != n or not out.is_contiguous()
              or out.device != x.device):
            raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {n} bytes on {x.device}, "
                             f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}")
        self._encode(x.float(), out)
        return out

    def decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """1-D uint8 of exactly nbytes(rows, cols) -> float32 [rows, cols], never a view of buf.
        Does not check that the values are finite."""
        rows, cols = _dim("rows", rows), _dim("cols", cols)
        n = self.nbytes(rows, cols)
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != n:
            got = f"{buf.dtype} of shape {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise ValueError(f"malformed {self.name} values: expected a 1-D uint8 tensor of {n} bytes "
                             f"for [{rows}, {cols}], got {got}")
        return self._decode(buf.contiguous(), rows, cols)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)): the float32 values a receiver of x will see."""
        return self.decode(self.encode(x), *x.shape)

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _decode(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
