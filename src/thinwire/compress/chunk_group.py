"""Many tensors of one chunk shape as one: `ChunkGroup` stacks their coefficient images in one
flat buffer and runs `ChunkedTopK`'s steps once per group instead of once per tensor.

Tensors whose plans share the chunk shape h × w (and pad no columns) join one group. Those of
one column count C stack on their rows into a band [R_j, C_j] (image i at rows [r_i, r_i +
R_i) of its band; tensors of one-row chunks lie end to end, so they count as C = w whatever
their widths: `geometry`), and the bands lie end to end (`thinwire.compress.chunk_bands`).
The group's chunks in order are band 0's (its tensors' in turn, each row-major over its
chunk grid), then band 1's, ... The right GEMM of both transforms, the top-k, the packing and
the decoding run once per group; only the left GEMM and the |·| pass run once per band.

The message keeps each tensor's own wire format at its own place (`ChunkedTopK`'s, byte for
byte): a group packs its indices, scales and values once, as streams over all its chunks,
and one index_copy moves those bytes to the tensors' places (`send`). That needs every
chunk's share of each stream to be whole bytes (`groupable`: k · index bits and k · value
bits multiples of 8); a tensor that fails it keeps the per-tensor path. A receiver gathers
every rank's bytes of the group with one `take` (`received`) into streams of W · Σchunks
rows, rank-major, and unpacks and decodes them once.
"""

from __future__ import annotations

import torch

from ..wire import VALUE_FORMATS, checks, index_width
from .chunk_bands import Bands
from .topk import ChunkedTopK


def groupable(comp: ChunkedTopK, shape) -> bool:
    """Whether a tensor of `shape` can join a group: no padded columns, packed indices, and
    each chunk's indices and values whole bytes (so streams split per tensor on byte bounds)."""
    plan, k = comp.plan(shape), comp.k(shape)
    fmt = VALUE_FORMATS[comp.codec.name]
    return (plan.cols == plan.padded_cols and comp.indices == "packed"
            and k * index_width(plan.chunk_elems) % 8 == 0 and k * fmt.bits % 8 == 0
            and comp.codec.nbytes(plan.num_chunks, k) == plan.num_chunks * (4 * fmt.row_floats + k * fmt.bits // 8))


def geometry(comp: ChunkedTopK, shape) -> tuple[int, int, int]:
    """(h, w, C): tensors of one (h, w) share a group, those of one C a band. One-row chunks
    (h = 1: biases, norms) lie end to end in row-major order, so such an image [R, C] is
    also [R·C / w, w] with the same chunks in the same order: those tensors share C = w,
    whatever their own widths."""
    plan = comp.plan(shape)
    cols = plan.chunk_cols if plan.chunk_rows == 1 else plan.padded_cols
    return plan.chunk_rows, plan.chunk_cols, cols


class ChunkGroup:
    """Tensors of `shapes` (one chunk shape h × w, each `groupable`) whose payloads start at
    `offsets` in a message of `nbytes` bytes. Consecutive tensors of one `geometry` C form a
    band (`thinwire.compress.chunk_bands`): give those of one C together, for fewer bands."""

    def __init__(self, comp: ChunkedTopK, shapes: list[tuple], offsets: list[int], nbytes: int, device):
        self.comp, self.shapes, self.nbytes, self.device = comp, [tuple(s) for s in shapes], nbytes, device
        plans = [comp.plan(s) for s in self.shapes]
        h, w, _ = geometry(comp, self.shapes[0])
        if any(geometry(comp, s)[:2] != (h, w) for s in self.shapes):
            raise ValueError(f"a ChunkGroup's tensors share one chunk shape, got {self.shapes}")
        self.images = [(plan.padded_rows, plan.padded_cols) for plan in plans]   # each tensor's own image
        self.sizes = [plan.padded_numel for plan in plans]
        self.starts = [sum(self.sizes[:i]) for i in range(len(plans))]          # its place in the flat image
        self.bands = Bands(_runs([geometry(comp, s)[2] for s in self.shapes], self.sizes), h, w, device)
        self.numel = self.bands.numel
        self.k = comp.k(self.shapes[0])
        self.coding = comp.coding(self.shapes[0])
        self.bits = index_width(h * w)
        fmt = VALUE_FORMATS[comp.codec.name]
        # bytes per chunk of each stream: indices, scales (per-chunk statistics), values
        self.per_chunk = (self.k * self.bits // 8, 4 * fmt.row_floats, self.k * fmt.bits // 8)
        self.chunks = [plan.num_chunks for plan in plans]
        self.send_index = self._send_index(offsets).to(device)
        self._received: dict[int, torch.Tensor] = {}

    @property
    def group_nbytes(self) -> int:
        return sum(self.chunks) * sum(self.per_chunk)

    def _send_index(self, offsets: list[int]) -> torch.Tensor:
        """[group bytes] int64: where each byte of the group's streams goes in the message.
        The group's bytes: every chunk's indices, then their scales, then their values; a
        tensor's payload: its chunks' indices, scales, values (ChunkedTopK's layout)."""
        streams = []
        for s, size in enumerate(self.per_chunk):
            parts = []
            for offset, chunks in zip(offsets, self.chunks):
                at = offset + sum(self.per_chunk[:s]) * chunks            # this stream inside the tensor's payload
                parts.append(torch.arange(at, at + chunks * size))
            streams.append(torch.cat(parts))
        return torch.cat(streams)

    def received_index(self, world: int) -> torch.Tensor:
        """[world · group bytes] int64 into the flat [world, nbytes] gathered payloads: each
        stream of every rank in rank order, so a stream is one of W · Σchunks rows."""
        if world not in self._received:
            n = sum(self.chunks)
            parts, at = [], 0
            for size in self.per_chunk:
                stream = self.send_index[at: at + n * size]                               # [n · size]
                # [world, n · size]: rank r's copy of the stream, r · nbytes further on
                parts.append((stream + torch.arange(world, device=stream.device)[:, None] * self.nbytes).view(-1))
                at += n * size
            self._received[world] = torch.cat(parts)
        return self._received[world]

    def forward(self, x: torch.Tensor, out: torch.Tensor, step: int, scratch: torch.Tensor,
                beta: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
        """out ← β·out + α·T(x) over the group's flat image (`ChunkTransform.forward_bands`)."""
        b = self.bands
        return self.comp.transform.forward_bands(x, out, b.h, b.w, b.layout, step, scratch=scratch, beta=beta,
                                                 alpha=alpha)

    def inverse(self, coeffs: torch.Tensor, step: int, scratch: torch.Tensor) -> torch.Tensor:
        """In place: the group's flat image ← T⁻¹(coeffs) (`ChunkTransform.inverse_bands`)."""
        b = self.bands
        return self.comp.transform.inverse_bands(coeffs, b.h, b.w, b.layout, step, scratch=scratch)

    def views(self, image: torch.Tensor) -> list[torch.Tensor]:
        """Tensor i's own image [R_i, C_i] in the group's flat image (contiguous)."""
        return [image[start: start + size].view(shape)
                for start, size, shape in zip(self.starts, self.sizes, self.images)]

    def crops(self, image: torch.Tensor) -> list[torch.Tensor]:
        """Tensor i's elements [*shape_i] in the group's image (its padding rows dropped)."""
        return [self.comp.plan(s).crop(v) for s, v in zip(self.shapes, self.views(image))]

    def send(self, image: torch.Tensor, payload: torch.Tensor, packed: torch.Tensor, scratch: torch.Tensor):
        """Every chunk's top-k of the group's flat `image` into each tensor's place in `payload` (the
        message after its prefix), through `packed` (uint8, group_nbytes). Returns
        (positions [chunks, k] in the image, the values as the wire delivers them [chunks, k])."""
        idx, positions, values = self.bands.select(image, self.k, scratch)
        n = sum(self.chunks)
        index_bytes = n * self.per_chunk[0]
        self.coding.pack(idx, out=packed[:index_bytes])
        self.comp.codec.encode(values, out=packed[index_bytes:])
        payload.index_copy_(0, self.send_index, packed)
        return positions, self.comp.codec.decode(packed[index_bytes:], n, self.k)

    def received(self, gathered: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Every rank's chunks from `gathered` (flat [world · nbytes] uint8): (positions
        [world, chunks, k] in the group's image, values [world, chunks, k] float32, 0-dim bool
        flags of malformed bytes: indices past a chunk (clamped) or non-finite values)."""
        n = world * sum(self.chunks)
        streams = torch.take(gathered, self.received_index(world))
        index_bytes = n * self.per_chunk[0]
        idx, bad_index = self.coding.unpack_flagged(streams[:index_bytes], n)
        values = self.comp.codec.decode(streams[index_bytes:], n, self.k)
        flags = [f for f in (bad_index, checks.nonfinite(values)) if f is not None]
        # [W · chunks, k] -> [W, chunks, k]: each rank's chunks against the group's chunk origins
        positions = self.bands.positions(idx.view(world, -1, self.k))
        return positions, values.view(world, -1, self.k), flags


def _runs(cols: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """Bands (rows, C) of consecutive tensors of one C, from each tensor's C and elements."""
    bands: list[list[int]] = []
    for c, size in zip(cols, sizes):
        if bands and bands[-1][1] == c:
            bands[-1][0] += size // c
        else:
            bands.append([size // c, c])
    return [(rows, c) for rows, c in bands]
