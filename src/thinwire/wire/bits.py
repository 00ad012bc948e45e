"""Vectorised packing of unsigned integers (1..32 bits each) and of signs into uint8 buffers.

Bit order, for every width: value i occupies stream bits [i*width, (i+1)*width), least
significant bit first, and stream bit j is bit (j % 8) of byte j // 8 (little-endian bit
order). The last byte is zero-padded, so `count` values take ceil(count * width / 8) bytes.
Example: width 12 packs [0xABC, 0x123] into bytes [0xBC, 0x3A, 0x12]; width 1 packs
[1, 0, 1, 1] into [0b00001101].

Byte views assume a little-endian host, as every platform torch ships for is.
"""

from __future__ import annotations

import math
import operator

import torch

from . import checks

_BYTE_DTYPES = {8: torch.uint8, 64: torch.int64}  # accumulator word size (bits) -> dtype


def _int_arg(name: str, value, low: int, high: int | None = None) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def index_width(n: int) -> int:
    """Bits needed to code the indices 0..n-1: max(1, ceil(log2 n)). 4096 -> 12, 4097 -> 13."""
    n = _int_arg("n", n, 1)
    return max(1, (n - 1).bit_length())  # exact for any n, unlike float log2


def packed_nbytes(count: int, width: int) -> int:
    """Bytes that `count` values of `width` bits occupy: ceil(count * width / 8)."""
    count, width = _int_arg("count", count, 0), _int_arg("width", width, 1, 32)
    return (count * width + 7) // 8


def _check_out(out: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes, got {type(out).__name__}")
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes, "
                         f"got {out.dtype} of shape {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out must be on {device}, got {out.device}")
    return out


def _check_buf(buf: torch.Tensor, nbytes: int, what: str) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        got = f"{buf.dtype} of shape {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise ValueError(f"buf must be a 1-D uint8 tensor, got {got}")
    if buf.numel() != nbytes:
        raise ValueError(f"expected {nbytes} bytes for {what}, got {buf.numel()}")


def _group(width: int) -> tuple[int, int]:
    """(values, bytes) of the smallest whole-byte group: lcm(width, 8) bits."""
    values = 8 // math.gcd(width, 8)
    return values, width * values // 8


def _pack_groups(vg: torch.Tensor, width: int, dst: torch.Tensor, word_bits: int) -> None:
    """Pack vg [m, g] (g values of `width` bits per row) into dst [m, gbytes] uint8.

    Each row is built one accumulator word (`word_bits` wide) at a time; the bit ranges of
    the values are disjoint, so OR-ing shifted values assembles the word exactly.
    """
    m, g = vg.shape
    wbytes = word_bits // 8
    word = torch.empty(m, dtype=_BYTE_DTYPES[word_bits], device=vg.device)
    scratch = torch.empty_like(word)
    for k in range(-(-dst.shape[1] // wbytes)):
        lo_bit, hi_bit = k * word_bits, (k + 1) * word_bits
        first = True
        for j in range(lo_bit // width, min(g, -(-hi_bit // width))):
            shift = j * width - lo_bit  # < 0: the value started in an earlier word
            target = word if first else scratch
            if shift >= 0:
                torch.bitwise_left_shift(vg[:, j], shift, out=target)  # bits past the word wrap away
            else:
                torch.bitwise_right_shift(vg[:, j], -shift, out=target)
            if not first:
                word.bitwise_or_(scratch)
            first = False
        lo, hi = k * wbytes, min((k + 1) * wbytes, dst.shape[1])
        dst[:, lo:hi].copy_(word.view(torch.uint8).view(m, wbytes)[:, : hi - lo])


_SHIFTS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _shifts(width: int, g: int, device) -> torch.Tensor:
    """[g] int64: value j of a group starts at bit j · width of its word (made once per
    width and device: a launch saved on every packing and unpacking; never written)."""
    key = (width, g, torch.device(device))
    if key in _SHIFTS:
        return _SHIFTS[key]
    shifts = torch.arange(0, g * width, width, dtype=torch.int64, device=device)
    if type(shifts) is torch.Tensor and shifts.device.type != "meta":   # not a tracer's fake tensor
        _SHIFTS[key] = shifts
    return shifts


def _pack_words(vg: torch.Tensor, width: int, dst: torch.Tensor) -> None:
    """_pack_groups for a group that fits one int64 below its sign bit (lcm(width, 8) <= 56
    bits: widths 1-8, 10, 12, 14, 20, 24, 28): the group's word is Σ_j v_j << j·width
    (disjoint bit ranges, so the sum is their OR), then its low bytes. 3 tensor ops instead of
    about 2 per value of the group."""
    m, g = vg.shape
    # [m, g] -> [m] words -> [m, 8] little-endian bytes -> the group's [m, gbytes]
    words = torch.bitwise_left_shift(vg, _shifts(width, g, vg.device)).sum(dim=1)
    dst.copy_(words.view(torch.uint8).view(m, 8)[:, : dst.shape[1]])


def _pack_stream(v: torch.Tensor, width: int, out: torch.Tensor, word_bits: int = 64) -> None:
    """Whole groups straight from v; the last partial group through a zero-padded copy."""
    g, gbytes = _group(width)
    pack = _pack_words if gbytes < 8 else (lambda vg, w, dst: _pack_groups(vg, w, dst, word_bits))
    full = v.numel() // g
    if full:
        pack(v[: full * g].view(full, g), width, out[: full * gbytes].view(full, gbytes))
    rest = v.numel() - full * g
    if rest:
        tail = v.new_zeros(1, g)
        tail[0, :rest] = v[full * g:]
        tail_bytes = out.new_empty(1, gbytes)
        pack(tail, width, tail_bytes)
        out[full * gbytes:].copy_(tail_bytes[0, : out.numel() - full * gbytes])


def pack_bits(values: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack integers in [0, 2**width) (any integer dtype and shape, flattened in C order)
    into a 1-D uint8 tensor of packed_nbytes(values.numel(), width) bytes, in the module's
    bit order, on values' device. `out`: a contiguous 1-D uint8 tensor of exactly that many
    bytes (e.g. a slice of a bigger buffer) to write into and return. Values out of range
    raise ValueError only with THINWIRE_DEBUG_CHECKS=1 (`thinwire.wire.checks`): the check
    reads the values on the host, and every caller in thinwire packs its own indices.
    """
    width = _int_arg("width", width, 1, 32)
    if not isinstance(values, torch.Tensor) or values.dtype.is_floating_point or values.dtype.is_complex:
        raise ValueError(f"values must be an integer tensor, got {getattr(values, 'dtype', type(values))}")
    v = values.reshape(-1).to(torch.int64)
    out = _check_out(out, packed_nbytes(v.numel(), width), v.device)
    if v.numel() == 0:
        return out
    if checks.enabled():
        _check_range(v, width)
    if width == 8:
        out.copy_(v)  # integer -> uint8 conversion keeps the low byte
    elif width in (16, 32):
        # low bytes of each little-endian int64 (a 32-bit value may not fit int32)
        out.view(-1, width // 8).copy_(v.view(torch.uint8).view(-1, 8)[:, : width // 8])
    else:
        _pack_stream(v, width, out)
    return out


def _check_range(v: torch.Tensor, width: int) -> None:
    """ValueError unless every value is in [0, 2**width) (a host read: debug checks only)."""
    lo, hi = torch.aminmax(v)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= 1 << width:
        raise ValueError(f"values must be in [0, 2**{width}) for width {width}, got min {lo} and max {hi}")


def _unpack_groups(src: torch.Tensor, width: int, dst: torch.Tensor, word_bits: int) -> None:
    """Inverse of _pack_groups: src [m, gbytes] uint8 -> dst [m, g] (any integer dtype)."""
    m, gbytes = src.shape
    wbytes, dtype = word_bits // 8, _BYTE_DTYPES[word_bits]
    words = []
    for lo in range(0, gbytes, wbytes):
        hi = min(lo + wbytes, gbytes)
        w = torch.zeros(m, wbytes, dtype=torch.uint8, device=src.device)
        w[:, : hi - lo] = src[:, lo:hi]
        words.append(w.view(dtype).view(m))
    scratch = torch.empty(m, dtype=dst.dtype, device=dst.device)
    for j in range(dst.shape[1]):
        k, s = divmod(j * width, word_bits)
        col = dst[:, j]
        torch.bitwise_right_shift(words[k], s, out=col)
        if s + width > word_bits:
            # int64 right shifts copy the sign bit: keep only the bits that came from this word
            col.bitwise_and_((1 << (word_bits - s)) - 1)
            torch.bitwise_left_shift(words[k + 1], word_bits - s, out=scratch)
            col.bitwise_or_(scratch)
        col.bitwise_and_((1 << width) - 1)


def _unpack_words(src: torch.Tensor, width: int, dst: torch.Tensor) -> None:
    """Inverse of _pack_words: src [m, gbytes] uint8 (gbytes < 8) -> dst [m, g], value j =
    (word >> j·width) & (2**width − 1) of the group's zero-extended int64 word."""
    m, gbytes = src.shape
    wide = torch.zeros(m, 8, dtype=torch.uint8, device=src.device)
    wide[:, :gbytes] = src
    words = wide.view(torch.int64)                                       # [m, 1], non-negative
    # [m, 1] >> [g] -> [m, g]
    torch.bitwise_right_shift(words, _shifts(width, dst.shape[1], src.device), out=dst)
    dst.bitwise_and_((1 << width) - 1)


def _unpack_stream(buf: torch.Tensor, width: int, count: int, dst: torch.Tensor, word_bits: int = 64) -> None:
    g, gbytes = _group(width)
    unpack = _unpack_words if gbytes < 8 else (lambda src, w, out: _unpack_groups(src, w, out, word_bits))
    full = count // g
    if full:
        unpack(buf[: full * gbytes].view(full, gbytes), width, dst[: full * g].view(full, g))
    rest = count - full * g
    if rest:
        tail = buf.new_zeros(1, gbytes)  # the partial group's bytes, zero-padded to a whole group
        tail[0, : buf.numel() - full * gbytes] = buf[full * gbytes:]
        tail_values = dst.new_empty(1, g)
        unpack(tail, width, tail_values)
        dst[full * g:] = tail_values[0, :rest]


def unpack_bits(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of pack_bits: `count` int64 values of `width` bits from a 1-D uint8 buffer of
    exactly packed_nbytes(count, width) bytes (ValueError otherwise). Padding bits are ignored.
    """
    nbytes = packed_nbytes(count, width)
    _check_buf(buf, nbytes, f"{count} values of {width} bits")
    buf = buf.contiguous()
    if width == 8:
        return buf.to(torch.int64)
    if width in (16, 32):
        wide = torch.zeros(count, 8, dtype=torch.uint8, device=buf.device)  # zero-extend to int64
        wide[:, : width // 8] = buf.view(count, width // 8)
        return wide.view(torch.int64).view(count)
    out = torch.empty(count, dtype=torch.int64, device=buf.device)
    _unpack_stream(buf, width, count, out)
    return out


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One bit per element of x (flattened), 8 per byte in the module's bit order:
    bit = 1 where x >= 0, so 0.0 and -0.0 code as +1; NaN compares false and codes as 0
    (negative). Returns (or fills `out` with) packed_nbytes(x.numel(), 1) bytes.
    """
    return pack_flags(x.reshape(-1) >= 0, out)


def pack_flags(flags: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One bit per element of a bool tensor (flattened), 8 per byte in the module's bit order:
    pack_bits(flags, 1) without widening to int64. Returns (or fills `out` with)
    packed_nbytes(flags.numel(), 1) bytes."""
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool:
        raise ValueError(f"flags must be a bool tensor, got {getattr(flags, 'dtype', type(flags))}")
    bits = flags.reshape(-1).view(torch.uint8)      # bool is stored as one 0/1 byte
    if bits.storage_offset() % 8:                   # whole bytes are read as int64 words: aligned
        bits = bits.clone()
    out = _check_out(out, packed_nbytes(bits.numel(), 1), flags.device)
    whole = bits.numel() // 8 * 8
    if whole:
        _pack_bytes_of_bits(bits[:whole], out[: whole // 8])
    if whole < bits.numel():
        _pack_stream(bits[whole:], 1, out[whole // 8:], word_bits=8)
    return out


# b_0 + 2^8 b_1 + 2^16 b_2 + 2^24 b_3 (each 0 or 1) times this puts b_j at bit 28 + j: the 16
# partial products 2^(28 + 8j − 7i) land on 16 distinct bits below 2^53, so nothing carries
# and nothing overflows int64
_GATHER_4 = (1 << 28) | (1 << 21) | (1 << 14) | (1 << 7)


def _pack_bytes_of_bits(bits: torch.Tensor, out: torch.Tensor) -> None:
    """bits [8m] uint8 of 0/1 -> out [m] uint8, bit j of byte i = bits[8i + j]: each 8 bytes
    read as one little-endian int64 word, its low and high 4 bytes gathered by one multiply."""
    words = bits.view(-1, 8).view(torch.int64).view(-1)                   # [m]: byte j of word i is bits[8i + j]
    low = torch.bitwise_and(words, 0xFFFFFFFF).mul_(_GATHER_4).bitwise_right_shift_(28).bitwise_and_(0xF)
    high = torch.bitwise_right_shift(words, 32).mul_(_GATHER_4).bitwise_right_shift_(24).bitwise_and_(0xF0)
    out.copy_(low.bitwise_or_(high))


def unpack_flags(buf: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of pack_flags: `count` bools from packed_nbytes(count, 1) bytes."""
    _check_buf(buf, packed_nbytes(count, 1), f"{count} flags")
    bits = torch.empty(count, dtype=torch.uint8, device=buf.device)
    _unpack_stream(buf.contiguous(), 1, count, bits, word_bits=8)
    return bits.view(torch.bool)


def unpack_signs(buf: torch.Tensor, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of pack_signs: `count` values of +1.0 (bit 1) or -1.0 (bit 0) in `dtype`."""
    nbytes = packed_nbytes(count, 1)
    _check_buf(buf, nbytes, f"{count} signs")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    bits = torch.empty(count, dtype=torch.uint8, device=buf.device)
    _unpack_stream(buf.contiguous(), 1, count, bits, word_bits=8)
    return bits.to(dtype).mul_(2).sub_(1)
