"""Bit streams shared by several tensors of one message, packed once for all of them.

A message that holds, per tensor, its own run of w-bit values (`pack_bits`' layout: the last
byte zero-padded) at its own byte offset can be written by one packing of all the tensors'
values if every tensor's share starts on a byte: `ShareStream` pads each share that does not
end on a byte with zero values up to a multiple of 8 values (8 · w bits: whole bytes), packs
once, and keeps the map from the packed bytes that carry real bits to their places in the
message. The padded tail of a share's last real byte is zero, as `pack_bits` writes it alone.

`MessageMap` joins such streams (and raw byte runs, e.g. float32 levels) into one scratch
buffer and two index tensors: writing a message is one `index_select` of the scratch and one
`index_copy_` into it; reading W gathered messages is one `take`, after which each stream's
W copies lie end to end, so one unpacking decodes every rank's values.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from .bits import packed_nbytes
from .indices import pack_stream, unpack_stream


class ShareStream:
    """Shares of `counts` values of `bits` bits each (bool flags, 1 bit, when `flags`), share j
    bound for byte `places[j]` of the message."""

    def __init__(self, counts: list[int], bits: int, flags: bool, places: list[int], device):
        self.bits, self.flags, self.count = bits, flags, sum(counts)
        aligned = all(n * bits % 8 == 0 for n in counts)
        padded = counts if aligned else [-(-n // 8) * 8 for n in counts]     # n rounded up to a multiple of 8
        starts = list(accumulate(padded, initial=0))
        self.padded_count = starts[-1]
        self.nbytes = packed_nbytes(self.padded_count, bits)
        self.pad: torch.Tensor | None = None                                 # value i -> its place when padded
        self.buffer: torch.Tensor | None = None
        if not aligned:
            self.pad = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)]).to(device)
            # zeros once: the padding values are never written, so they stay zero
            self.buffer = torch.zeros(self.padded_count, dtype=torch.bool if flags else torch.int64, device=device)
        # the bytes of share j that carry its bits: packed byte start_j·w/8 + b -> message byte places[j] + b
        sizes = [packed_nbytes(n, bits) for n in counts]
        self.src = _runs([s * bits // 8 for s in starts[:-1]], sizes)
        self.dst = _runs(places, sizes)

    def pack(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """values [count] (every share's, in order) -> `out`, nbytes uint8."""
        if self.pad is not None:
            # padded[pad[i]] = values[i]
            values = self.buffer.index_copy_(0, self.pad, values.reshape(-1))
        pack_stream(values.reshape(-1), self.bits, out=out)

    def unpack(self, buf: torch.Tensor, world: int) -> torch.Tensor:
        """`world` copies of the packed stream end to end (world · nbytes uint8) -> [world, count]."""
        values = unpack_stream(buf, self.bits, world * self.padded_count, self.flags)
        values = values.view(world, self.padded_count)                       # [W, padded values]
        return values if self.pad is None else values.index_select(1, self.pad)


class MessageMap:
    """Raw byte runs and `ShareStream`s, end to end in one scratch buffer (`packed`, uint8),
    mapped into a message of `nbytes` bytes. Raw runs come first (4-byte aligned for float
    views when their sizes are multiples of 4)."""

    def __init__(self, raw: list[tuple[int, list[int]]], streams: list[ShareStream], nbytes: int, device):
        """raw: (bytes per part, each part's place in the message) for each run."""
        self.streams, self.nbytes, self.device = streams, nbytes, torch.device(device)
        src, dst, self.raw_at, at = [], [], [], 0
        for size, places in raw:
            self.raw_at.append(at)
            src.append(_runs([at + j * size for j in range(len(places))], [size] * len(places)))
            dst.append(_runs(places, [size] * len(places)))
            at += size * len(places)
        self.stream_at = []
        for stream in streams:
            self.stream_at.append(at)
            src.append(stream.src + at)
            dst.append(stream.dst)
            at += stream.nbytes
        self.total = at
        self.packed = torch.zeros(at, dtype=torch.uint8, device=device)
        src, dst = torch.cat(src), torch.cat(dst)
        # packed byte -> message byte (bytes of padding only: byte 0, read and dropped)
        self._where = torch.zeros(at, dtype=torch.int64).index_copy_(0, src, dst)
        self.src, self.dst = src.to(device), dst.to(device)
        self._received: dict[int, torch.Tensor] = {}

    def stream_out(self, s: int) -> torch.Tensor:
        return self.packed[self.stream_at[s]: self.stream_at[s] + self.streams[s].nbytes]

    def raw_out(self, r: int, nbytes: int) -> torch.Tensor:
        return self.packed[self.raw_at[r]: self.raw_at[r] + nbytes]

    def write(self, message: torch.Tensor) -> None:
        """The packed bytes that carry bits into their places in `message` (uint8, nbytes)."""
        # message[dst[i]] = packed[src[i]]
        message.index_copy_(0, self.dst, self.packed.index_select(0, self.src))

    def received_index(self, world: int) -> torch.Tensor:
        """[world · total] int64 into [world, nbytes] messages, flat: each run and stream of
        every rank in rank order (a stream's W copies end to end)."""
        if world not in self._received:
            ranks = torch.arange(world).unsqueeze(1) * self.nbytes                # [W, 1]
            bounds = [*self.raw_at, *self.stream_at, self.total]
            parts = [(self._where[a:b].unsqueeze(0) + ranks).view(-1) for a, b in zip(bounds, bounds[1:]) if b > a]
            self._received[world] = torch.cat(parts).to(self.device)
        return self._received[world]

    def read(self, messages: torch.Tensor) -> torch.Tensor:
        """[world, nbytes] uint8 -> the received scratch: per run and stream, W copies end to end."""
        world = messages.shape[0]
        return messages.reshape(-1).take(self.received_index(world))


def _runs(starts: list[int], sizes: list[int]) -> torch.Tensor:
    """[Σ sizes] int64: start_j, start_j + 1, ..., start_j + size_j − 1 for each j in turn (CPU)."""
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    total = int(sizes_t.sum())
    # each element's run j, and its place b in that run: start_j + b
    run = torch.repeat_interleave(torch.arange(len(sizes)), sizes_t)
    first = torch.cumsum(sizes_t, 0) - sizes_t                                   # where run j begins
    return torch.tensor(starts, dtype=torch.int64)[run] + torch.arange(total) - first[run]
