"""Codings of a top-k's chunk-local indices: k distinct indices in 0..n-1 per row (chunk), rows
of one tensor in row order, every size a function of (rows, k, n) alone.

'packed'       each index in ceil(log2 n) bits, in any order (`pack_bits`):
                   rows · k · ceil(log2 n) bits
'elias-fano'   each row's indices ascending, split at L = floor(log2(n / k)) bits (Elias 1974,
               Fano 1971; the layout of Vigna, "Quasi-succinct indices", 2013):
                   lows     the low L bits of each index, `pack_bits`, rows · k · L bits
                   uppers   per row a bitmap of B = k + ((n − 1) >> L) + 1 bits with bit
                            (idx_i >> L) + i set for the i-th smallest index: exactly k ones
                   rows · (k · L + B) bits, the lows of all rows first, then all the bitmaps

At SparseLoCo's 32 of 1024 that is 5 + 2 = 7 bits per index instead of 10 (224 bits a chunk
against 320), within 10 bits a chunk of the log2(C(1024, 32)) ≈ 214 that any coding of the set
needs. The price is order: a row's values must be sent in ascending index order, so the
sender sorts each row's indices (`sorted`), and a receiver decodes them ascending.

Each coding is a list of bit streams (values per row, bits each) so that a caller packing
several tensors can pack each stream once over all their rows (`split` / `join`); `pack` and
`unpack` are the one-tensor form. `join` validates: indices in range, and for 'elias-fano'
k ones per bitmap and strictly ascending indices (no index twice), else ValueError.
`join_flagged` / `unpack_flagged` validate on the device instead (no host read): they return
the indices (clamped into range, so a scatter with them stays in bounds) and a 0-dim bool,
True when the bytes were malformed (`thinwire.wire.checks`), for the caller to read once.
"""

from __future__ import annotations

import torch

from .bits import index_width, pack_bits, pack_flags, packed_nbytes, unpack_bits, unpack_flags

INDEX_CODINGS = ("packed", "elias-fano")


class PackedIndices:
    """'packed': ceil(log2 n) bits per index, in the order given."""

    name, sorted = "packed", False

    def __init__(self, k: int, n: int):
        self.k, self.n = k, n
        self.streams = ((k, index_width(n), False),)   # (values per row, bits each, flags: bool bits)

    def split(self, idx: torch.Tensor) -> list[torch.Tensor]:
        return [idx]

    def join(self, parts: list[torch.Tensor], rows: int) -> torch.Tensor:
        idx = parts[0].view(rows, self.k)
        if idx.numel() and int(idx.max()) >= self.n:
            raise ValueError(f"malformed payload: index {int(idx.max())} out of range for a chunk of {self.n}")
        return idx

    def join_flagged(self, parts: list[torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`join` with the range check on the device: (idx [rows, k] clamped to n − 1, a 0-dim
        bool flag, True if an index was >= n; None when n = 2**width, where none can be)."""
        idx = parts[0].view(rows, self.k)
        if self.n == 1 << self.streams[0][1] or not idx.numel():
            return idx, None
        bad = (idx >= self.n).any()
        return idx.clamp(max=self.n - 1), bad

    def unpack_flagged(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`unpack` validated on the device (`join_flagged`)."""
        return self.join_flagged(self._parts(buf, rows), rows)

    def nbytes(self, rows: int) -> int:
        return sum(packed_nbytes(rows * m, bits) for m, bits, _ in self.streams)

    def pack(self, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """idx [rows, k] int64 (ascending per row if `sorted`) -> `out`, nbytes(rows) uint8."""
        at = 0
        for part, (_, bits, _) in zip(self.split(idx), self.streams):
            size = packed_nbytes(part.numel(), bits)
            pack_stream(part, bits, out[at: at + size])
            at += size
        return out

    def unpack(self, buf: torch.Tensor, rows: int) -> torch.Tensor:
        """nbytes(rows) uint8 -> idx [rows, k] int64, validated (ValueError if malformed)."""
        return self.join(self._parts(buf, rows), rows)

    def _parts(self, buf: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """The coding's streams of nbytes(rows) uint8, unpacked."""
        parts, at = [], 0
        for m, bits, flags in self.streams:
            size = packed_nbytes(rows * m, bits)
            parts.append(unpack_stream(buf[at: at + size], bits, rows * m, flags))
            at += size
        return parts


class EliasFanoIndices(PackedIndices):
    """'elias-fano': the module docstring's lows and upper-bit bitmaps, rows ascending."""

    name, sorted = "elias-fano", True

    def __init__(self, k: int, n: int):
        super().__init__(k, n)
        self.low = max(0, (n // k).bit_length() - 1)                 # L = floor(log2(n / k))
        self.bitmap = k + ((n - 1) >> self.low) + 1                  # B
        self.streams = ((k, self.low, False),) * (self.low > 0) + ((self.bitmap, 1, True),)
        self._rank: torch.Tensor | None = None                      # [k] 0..k-1

    def split(self, idx: torch.Tensor) -> list[torch.Tensor]:
        rows, rank = idx.shape[0], self._ranks(idx.device)
        # bit (idx_i >> L) + i of each row's bitmap, i the index's rank in its row   [rows, B]
        flags = torch.zeros(rows, self.bitmap, dtype=torch.bool, device=idx.device)
        flags.scatter_(1, torch.bitwise_right_shift(idx, self.low).add_(rank), True)
        lows = [torch.bitwise_and(idx, (1 << self.low) - 1)] if self.low else []
        return [*lows, flags]

    def join(self, parts: list[torch.Tensor], rows: int) -> torch.Tensor:
        flags = parts[-1].view(rows, self.bitmap)
        ones = flags.sum(dim=1)
        if rows and not bool((ones == self.k).all()):
            bad = int(ones[ones != self.k][0])
            raise ValueError(f"malformed payload: an upper-bit bitmap holds {bad} indices, expected {self.k}")
        idx = self._uppers(flags)
        idx.bitwise_left_shift_(self.low)
        if self.low:
            idx.bitwise_or_(parts[0].view(rows, self.k))
        if idx.numel() and int(idx[:, -1].max()) >= self.n:
            raise ValueError(f"malformed payload: index {int(idx[:, -1].max())} out of range for a chunk of {self.n}")
        if self.k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise ValueError("malformed payload: a chunk's indices are not strictly ascending (an index twice)")
        return idx

    def join_flagged(self, parts: list[torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Elias-Fano's checks stay on the host (`join`, raising): a malformed bitmap would
        otherwise scatter out of bounds. No flag."""
        return self.join(parts, rows), None

    def _uppers(self, flags: torch.Tensor) -> torch.Tensor:
        """idx_i >> L of every row from its bitmap [rows, B] of exactly k ones: a one at
        position p is the i-th of its row (i = the ones up to p, less 1) and holds p − i.
        One scatter of every position, the zeros into a spare column k (nonzero() is 2-3x
        slower on CPU)."""
        rows, width = flags.shape
        ones = flags.view(torch.uint8)                                      # [rows, B]
        before = ones.cumsum(dim=1, dtype=torch.int32)                      # ones in [0, p]
        value = torch.sub(torch.arange(width, dtype=torch.int32, device=flags.device), before).add_(1)   # p − i
        # i = before − 1 at a one, k at a zero: k + one · (before − 1 − k), in int32 (where() and
        # masked_fill_, and int64 throughout, are slower here)
        at = before.sub_(1 + self.k).mul_(ones).add_(self.k).long()
        out = torch.empty(rows, self.k + 1, dtype=torch.int32, device=flags.device)
        return out.scatter_(1, at, value)[:, : self.k].long()

    def _ranks(self, device) -> torch.Tensor:
        if self._rank is None or self._rank.device != torch.device(device):
            self._rank = torch.arange(self.k, device=device)
        return self._rank


def check_index_coding(name) -> str:
    if name not in INDEX_CODINGS:
        raise ValueError(f"indices must be one of {INDEX_CODINGS}, got {name!r}")
    return name


def index_coding(name: str, k: int, n: int) -> PackedIndices:
    """The coding `name` of k distinct indices in 0..n-1 per row (1 <= k <= n)."""
    return PackedIndices(k, n) if check_index_coding(name) == "packed" else EliasFanoIndices(k, n)


def pack_stream(values: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """One stream: flags (bool) one bit each, integers `bits` each."""
    return pack_flags(values, out=out) if values.dtype == torch.bool else pack_bits(values, bits, out=out)


def unpack_stream(buf: torch.Tensor, bits: int, count: int, flags: bool) -> torch.Tensor:
    """Inverse of pack_stream: `count` bool flags, or int64 values of `bits` bits."""
    return unpack_flags(buf, count) if flags else unpack_bits(buf, bits, count)
