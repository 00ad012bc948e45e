"""Vectorised bit packing of unsigned integers and signs into uint8 buffers.

Bit order: value i occupies stream bits [i*width, (i+1)*width), least significant bit
first; stream bit j is bit (j % 8) of byte j // 8. The last byte is zero-padded. So
width 12 packs [0xABC, 0x123] into bytes [0xBC, 0x3A, 0x12].
"""

from __future__ import annotations

import math

import torch

_BYTE_WIDTHS = {8: 1, 16: 2, 32: 4}


def index_width(n: int) -> int:
    """Bits needed to code the indices 0..n-1: max(1, ceil(log2 n))."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return max(1, math.ceil(math.log2(n)))


def packed_nbytes(count: int, width: int) -> int:
    """Bytes that `count` values of `width` bits occupy: ceil(count * width / 8)."""
    _check_width(width)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return (count * width + 7) // 8


def _check_width(width: int) -> None:
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in 1..32, got {width}")


def _check_out(out: torch.Tensor | None, nbytes: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes:
        raise ValueError(f"out must be a 1-D uint8 tensor of {nbytes} bytes, got {out.dtype} {tuple(out.shape)}")
    return out


def _bit_weights(device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(values: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack integers in [0, 2**width) into a 1-D uint8 tensor of packed_nbytes bytes."""
    _check_width(width)
    v = values.reshape(-1).to(torch.int64)
    nbytes = packed_nbytes(v.numel(), width)
    out = _check_out(out, nbytes, v.device)
    if v.numel() == 0:
        return out
    lo, hi = torch.aminmax(v)
    if int(lo) < 0 or int(hi) >= 1 << width:
        raise ValueError(f"values must be in [0, 2**{width}), got range [{int(lo)}, {int(hi)}]")
    if width in _BYTE_WIDTHS:
        # little-endian int64 bytes; keep the low `width / 8` bytes of each value
        out.copy_(v.view(torch.uint8).view(-1, 8)[:, : _BYTE_WIDTHS[width]].reshape(-1))
        return out
    shifts = torch.arange(width, device=v.device)
    bits = ((v[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)    # [count * width]
    pad = nbytes * 8 - bits.numel()
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    out.copy_((bits.view(-1, 8) * _bit_weights(v.device)).sum(dim=1, dtype=torch.uint8))
    return out


def _check_buf(buf: torch.Tensor, nbytes: int, what: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != nbytes:
        raise ValueError(f"expected {nbytes} bytes for {what}, got a {buf.dtype} tensor of shape {tuple(buf.shape)}")


def unpack_bits(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of pack_bits: `count` int64 values from a buffer of packed_nbytes bytes."""
    nbytes = packed_nbytes(count, width)
    _check_buf(buf, nbytes, f"{count} values of {width} bits")
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=buf.device)
    if width in _BYTE_WIDTHS:
        k = _BYTE_WIDTHS[width]
        wide = torch.zeros(count, 8, dtype=torch.uint8, device=buf.device)
        wide[:, :k] = buf.view(count, k)
        return wide.view(torch.int64).view(-1)
    bits = ((buf[:, None] >> torch.arange(8, device=buf.device, dtype=torch.uint8)) & 1)   # [nbytes, 8]
    bits = bits.reshape(-1)[: count * width].view(count, width).to(torch.int64)
    return (bits << torch.arange(width, device=buf.device)).sum(dim=1)


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One bit per element, 1 where x >= 0 (so 0 and -0.0 code as +1; NaN codes as -1)."""
    flat = x.reshape(-1)
    return pack_bits((flat >= 0).to(torch.uint8), 1, out=out) if flat.numel() else _check_out(out, 0, x.device)


def unpack_signs(buf: torch.Tensor, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """+1.0 / -1.0 values of the `count` signs packed in `buf`."""
    bits = unpack_bits(buf, 1, count)
    return (bits * 2 - 1).to(dtype)
