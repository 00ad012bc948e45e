"""The pieces of an EF21 message over rows: R tensors of one size d at once, each row one
tensor, each row's bytes exactly what the per-tensor compressor (`thinwire.compress.sparse`,
`thinwire.compress.ef21`) writes for that tensor. `thinwire.compress.ef21_blocks` lays the rows
of every block into one message.

    RowIndices    K positions per row: 'packed' (K indices of index_width(d) bits, any order)
                  or 'bitmap' (d bits; positions ascending), as TopK sends them
    RowValues     K values per row in a value stage: 'fp32', 'bf16', 'fp16' (the float codec
                  over all rows at once), 'int8' (the codec over the rows: a scale per row) or
                  'natural' (the rows' sign bits, then their exponents)
    device_generator  a generator on the tensors' device, seeded alike on every rank

Packed indices are packed with each row padded to whole bit groups (`_group`), so a row's
first `nbytes` bytes are the per-tensor packing and one unpack serves every row; what follows
them in a row (its padding) only reaches the padded values, which are dropped. No operation
here reads the device from the host: a bitmap's count is checked on the device (`bad`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..wire import pack_bits, pack_flags, packed_nbytes, unpack_bits, unpack_flags

_MANTISSA = 1 << 23
FLOAT_STAGES = ("fp32", "bf16", "fp16")
ROW_STAGES = FLOAT_STAGES + ("int8", "natural")


def device_generator(seed: int, device) -> torch.Generator:
    """A generator on `device` (draws made there: nothing copied from the host), seeded with
    `seed` on every rank; on the CPU the stream of `value_stages.generator(seed)`."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)


def _group(width: int) -> int:
    """Values in the smallest whole-byte group of `width`-bit values: lcm(width, 8) / width."""
    return 8 // math.gcd(width, 8)


class RowIndices:
    """K positions in each of R rows of d: 'packed' or 'bitmap' (module docstring)."""

    def __init__(self, coding: str, d: int, k: int, width: int):
        self.coding, self.d, self.k, self.width = coding, d, k, width
        if coding == "bitmap":
            self.nbytes = self.row_nbytes = packed_nbytes(d, 1)
            self.kpad = k
        else:
            g = _group(width)
            self.kpad = -(-k // g) * g
            self.nbytes = packed_nbytes(k, width)                     # a row's bytes in the message
            self.row_nbytes = packed_nbytes(self.kpad, width)          # its padded packing
        assert self.row_nbytes >= self.nbytes

    def ascending(self) -> bool:
        """Whether the values follow their positions in ascending order (the bitmap's)."""
        return self.coding == "bitmap"

    def pack(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """idx [R, K] (ascending rows for a bitmap) -> out [R · row_nbytes] uint8."""
        rows = idx.shape[0]
        if self.coding == "bitmap":
            mask = torch.zeros(rows, 8 * self.row_nbytes, dtype=torch.bool, device=idx.device)
            pack_flags(mask.scatter_(1, idx, True), out=out)
            return
        padded = F.pad(idx, (0, self.kpad - self.k)) if self.kpad > self.k else idx
        pack_bits(padded, self.width, out=out)

    def unpack(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """buf: `rows` padded rows of bytes (any leading shape, last dim row_nbytes) -> (int64
        [rows, K] positions, ascending for a bitmap; a 0-dim bool, True where a bitmap row does
        not mark exactly K positions, else None). Packed positions are not range checked."""
        flat = buf.reshape(-1)
        if self.coding == "bitmap":
            bits = unpack_flags(flat, rows * 8 * self.row_nbytes).view(rows, -1)[:, :self.d]
            bad = bits.sum(dim=1).ne_(self.k).any()
            positions = bits.view(torch.uint8).topk(self.k, dim=1).indices.sort(dim=1).values
            return positions, bad
        idx = unpack_bits(flat, self.width, rows * self.kpad).view(rows, self.kpad)
        return idx[:, :self.k], None


class RowValues:
    """K values per row in a value stage. A block's value bytes are its rows' first parts,
    then their second parts (`parts`: a row's bytes of each), in one span of R · `nbytes`:
    a float stage one part (the codec over the rows at once), 'int8' the codec's own layout
    (R scales, then the rows' bytes: a scale per row, each row's bytes the per-tensor codec's),
    'natural' the rows' sign bits (padded to whole bytes), then their exponents."""

    def __init__(self, stage, k: int):
        self.stage, self.k, self.name = stage, k, stage.name
        if self.name not in ROW_STAGES:
            raise ValueError(f"no row form of the value stage {self.name!r}")
        if self.name == "natural":
            self.parts = [packed_nbytes(k, 1), k]                          # sign bits, exponents
        elif self.name == "int8":
            self.parts = [4, k]                                            # float32 scale, int8 values
        else:
            self.parts = [stage.nbytes(k)]
        self.nbytes = sum(self.parts)
        self.align = 4 if self.name == "int8" else 1                       # where a block's span starts

    @property
    def is_float(self) -> bool:
        return self.name in FLOAT_STAGES

    def encode(self, v: torch.Tensor, out: torch.Tensor, gen: torch.Generator | None) -> None:
        """v [R, K] -> out, R · nbytes contiguous uint8. 'natural' rounds up with probability
        (|v| − 2^e) / 2^e, drawn from `gen` on v's device."""
        rows = v.shape[0]
        if self.name != "natural":
            self.stage.codec.encode(v, out=out)
            return
        v = v.float().contiguous()
        bits = v.view(torch.int32)
        exponent = (bits >> 23) & 0xFF
        draws = torch.randint(0, _MANTISSA, v.shape, generator=gen, dtype=torch.int32, device=v.device)
        up = (draws < (bits & (_MANTISSA - 1))) & (exponent < 255)
        out[rows * self.parts[0]:].view(rows, self.k).copy_(exponent.add_(up))
        signs = v >= 0
        if 8 * self.parts[0] > self.k:
            signs = F.pad(signs, (0, 8 * self.parts[0] - self.k))
        pack_flags(signs, out=out[: rows * self.parts[0]])

    def decode(self, buf: torch.Tensor, members: int) -> torch.Tensor:
        """buf [W, members · nbytes] (each rank's span) -> float32 [W · members, K]."""
        rows, cut = buf.shape[0] * members, members * self.parts[0]
        if self.is_float:
            return buf.reshape(-1).view(self.stage.codec.dtype).view(rows, self.k).float()
        if self.name == "int8":                                            # as Int8Codec decodes a row
            scale = buf[:, :cut].view(torch.float32).reshape(rows, 1)
            return buf[:, cut:].reshape(rows, self.k).view(torch.int8).float().mul_(scale).div_(127)
        signs = unpack_flags(buf[:, :cut].reshape(-1), rows * 8 * self.parts[0]).view(rows, -1)[:, :self.k]
        magnitude = (buf[:, cut:].reshape(rows, self.k).to(torch.int32) << 23).view(torch.float32)  # 0 -> 0.0, 255 -> inf
        return torch.where(signs, magnitude, magnitude.neg())
