"""SparseLoCo's compressor over all the tensors of one flat float32 buffer at once
(`FlatSparseLoCo`): every tensor's bytes are what `SparseLoCoTopK.encode` writes for it alone,
and what a receiver decodes is the same, with far fewer tensor operations.

The tensors x_i lie end to end in a flat buffer x (`thinwire.optim.flat.spans`), and so do
their payloads. Tensors that share a chunk geometry (h, w, k), are unpadded, and take
'identity' top-k with '2bit' values form a group (a model's matrices usually form one, its
vectors another). A group's G chunks, over all its tensors, go through one pass of each step:

    |x| in chunk-major order       [G, h·w]   one strided copy per tensor into one buffer
    top-k of every chunk           [G, k]     one `largest_indices`
    flat positions in x            [G, k]     chunk-local index (u, v) -> u·cols + v + origin
    the kept values                [G, k]     one `torch.take` from x
    2-bit codes, levels            per tensor `quantize_row_groups`, one group per tensor
    bit packing                    one `pack_bits` of the indices and one of the codes when
                                   every tensor's share ends on a byte, else one per tensor

then each tensor's index bytes, 16 level bytes and code bytes are copied into its payload.
The kept values are ordered as the per-tensor path orders them (its chunks, then top-k's
order in each), so the bytes are equal; the statistics are float64 sums in another order,
rounded once to float32 (the same levels but for ties at that rounding). Any other tensor
(padded, 'dct', other value formats) goes through `SparseLoCoTopK` on its own.

What a sync's message decodes to is kept as `Piece`s: sparse values at flat positions in x
(groups, and identity tensors on their own) or one tensor's dense decoded values ('dct').
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Sequence

import torch

from ..ops.select import largest_indices
from ..optim.flat import Span, spans
from ..wire import index_width, pack_bits, packed_nbytes, unpack_bits
from ..wire.twobit import LEVELS, quantize_row_groups
from .payload import Payload
from .sparseloco_topk import SparseLoCoTopK

LEVEL_BYTES = 4 * LEVELS                       # one tensor's float32 levels


class Piece(NamedTuple):
    """Part of one rank's decoded message. `members`: layout indices of its tensors; `bounds`:
    member j's entries are values[bounds[j]: bounds[j + 1]]; `positions`: int64 flat
    positions in x (None: `values` is the one member's dense tensor, flat)."""
    members: tuple[int, ...]
    bounds: tuple[int, ...]
    positions: torch.Tensor | None
    values: torch.Tensor


class _Group:
    """Tensors sharing (h, w, k), as one [G, h·w] matrix of chunks (the module docstring)."""

    def __init__(self, members, plans, elements: list[Span], payloads: list[Span], compressor, device):
        self.members, self.h, self.w = tuple(members), plans[0].chunk_rows, plans[0].chunk_cols
        self.k, self.width = compressor.k(plans[0].shape), index_width(plans[0].chunk_elems)
        self.plans, self.elements, self.payloads = plans, elements, payloads
        self.chunks = [p.num_chunks for p in plans]
        self.rows = sum(self.chunks)
        self.bounds = tuple(self.k * r for r in accumulate(self.chunks, initial=0))
        counts = [c * self.k for c in self.chunks]
        self.aligned = all(c * self.width % 8 == 0 and c % 4 == 0 for c in counts)
        self.index_bytes = [packed_nbytes(c, self.width) for c in counts]
        self.code_bytes = [packed_nbytes(c, 2) for c in counts]
        # per chunk: the flat position of its (0, 0) in x and its tensor's columns  [G, 1]
        origins, cols = [], []
        for plan, span in zip(plans, elements):
            (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
            o = torch.arange(gr)[:, None] * (h * plan.cols) + torch.arange(gc)[None, :] * w + span.start
            origins.append(o.view(-1))
            cols.append(torch.full((gr * gc,), plan.cols))
        self.origin = torch.cat(origins).view(-1, 1).to(device)
        self.cols = torch.cat(cols).view(-1, 1).to(device)
        self.tensor_of_row = torch.repeat_interleave(torch.arange(len(plans)), torch.tensor(self.chunks)).to(device)

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """Chunk-local indices [G, k] -> flat positions in x [G, k]: u·cols + v + origin."""
        u = torch.div(idx, self.w, rounding_mode="floor")
        return (idx - u * self.w).add_(u * self.cols).add_(self.origin)

    def encode(self, x: torch.Tensor, payload: torch.Tensor, magnitude: torch.Tensor) -> Piece:
        """This group's bytes into `payload`, from x (flat float32); `magnitude`: [>= G·h·w] scratch."""
        mag = magnitude[: self.rows * self.h * self.w].view(self.rows, self.h * self.w)
        start = 0
        for plan, span, chunks in zip(self.plans, self.elements, self.chunks):
            (gr, gc), h, w = plan.grid, self.h, self.w
            # [R, C] -> [gr, h, gc, w] -> [gr, gc, h, w]: |x| chunk-major, one strided pass
            image = span.of(x).view(gr, h, gc, w).permute(0, 2, 1, 3)
            torch.abs(image, out=mag[start: start + chunks].view(gr, gc, h, w))
            start += chunks
        idx = largest_indices(mag, self.k)                                        # [G, k]
        positions = self.positions(idx)                                           # [G, k]
        kept = torch.take(x, positions)                                           # [G, k]
        q, levels = quantize_row_groups(kept, self.tensor_of_row, len(self.members))
        self._write(idx, q, levels, payload)
        # x̂ = t_q: what a receiver decodes, as the codec's decode computes it
        sent = levels.view(-1).take(q + LEVELS * self.tensor_of_row.unsqueeze(1))
        return Piece(self.members, self.bounds, positions.view(-1), sent.view(-1))

    def _write(self, idx: torch.Tensor, q: torch.Tensor, levels: torch.Tensor, payload: torch.Tensor) -> None:
        level_bytes = levels.contiguous().view(torch.uint8).view(-1, LEVEL_BYTES)
        if self.aligned:
            index_stream, code_stream = pack_bits(idx, self.width), pack_bits(q, 2)
        cut_i = cut_c = 0
        for j, span in enumerate(self.payloads):
            out, ni, nc = span.of(payload), self.index_bytes[j], self.code_bytes[j]
            rows = slice(self.bounds[j] // self.k, self.bounds[j + 1] // self.k)
            if self.aligned:
                out[:ni].copy_(index_stream[cut_i: cut_i + ni])
                out[ni + LEVEL_BYTES:].copy_(code_stream[cut_c: cut_c + nc])
            else:
                pack_bits(idx[rows], self.width, out=out[:ni])
                pack_bits(q[rows], 2, out=out[ni + LEVEL_BYTES:])
            out[ni: ni + LEVEL_BYTES].copy_(level_bytes[j])
            cut_i, cut_c = cut_i + ni, cut_c + nc

    def read(self, payload: torch.Tensor) -> Piece:
        """One rank's bytes of this group -> its Piece, validated as `SparseLoCoTopK.read` does."""
        parts = [span.of(payload) for span in self.payloads]
        index_parts = [b[:n] for b, n in zip(parts, self.index_bytes)]
        code_parts = [b[n + LEVEL_BYTES:] for b, n in zip(parts, self.index_bytes)]
        count, elems = self.rows * self.k, self.h * self.w
        if self.aligned:
            idx = unpack_bits(torch.cat(index_parts), self.width, count)
            q = unpack_bits(torch.cat(code_parts), 2, count)
        else:
            idx = torch.cat([unpack_bits(b, self.width, c * self.k) for b, c in zip(index_parts, self.chunks)])
            q = torch.cat([unpack_bits(b, 2, c * self.k) for b, c in zip(code_parts, self.chunks)])
        if int(idx.max()) >= elems:
            raise ValueError(f"malformed payload: index {int(idx.max())} out of range for a chunk of {elems}")
        levels = torch.cat([b[n: n + LEVEL_BYTES] for b, n in zip(parts, self.index_bytes)]).view(torch.float32)
        sent = levels.take(q.view(self.rows, self.k) + LEVELS * self.tensor_of_row.unsqueeze(1)).view(-1)
        if not bool(torch.isfinite(sent).all()):
            raise ValueError("malformed payload: non-finite values")
        return Piece(self.members, self.bounds, self.positions(idx.view(self.rows, self.k)).view(-1), sent)


class FlatSparseLoCo:
    """`SparseLoCoTopK` over the tensors of these shapes, laid end to end in a flat float32
    buffer and their payloads end to end in a uint8 one (the module docstring)."""

    def __init__(self, compressor: SparseLoCoTopK, shapes: Sequence[tuple[int, ...]], device):
        self.compressor, self.shapes = compressor, [tuple(s) for s in shapes]
        self.elements = spans(torch.Size(s).numel() for s in self.shapes)
        self.payloads = spans(compressor.payload_nbytes(s) for s in self.shapes)
        self.groups, self.alone, geometry = [], [], {}
        for i, shape in enumerate(self.shapes):
            plan = compressor.plan(shape)
            if compressor.transform.kind == "identity" and compressor.codec.name == "2bit" and not plan.padded:
                geometry.setdefault((plan.chunk_rows, plan.chunk_cols, compressor.k(shape)), []).append(i)
            else:
                self.alone.append(i)
        for members in geometry.values():
            self.groups.append(_Group(members, [compressor.plan(self.shapes[i]) for i in members],
                                      [self.elements[i] for i in members], [self.payloads[i] for i in members],
                                      compressor, device))
        self._magnitude: torch.Tensor | None = None
        self._count_buf: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.elements[-1].stop if self.elements else 0

    def encode(self, x: torch.Tensor, payload: torch.Tensor, step: int = 0) -> list[Piece]:
        """Every tensor's bytes into its span of `payload`, from its span of x; what receivers decode."""
        pieces = []
        if self.groups:
            need = max(g.rows * g.h * g.w for g in self.groups)
            if self._magnitude is None or self._magnitude.numel() < need or self._magnitude.device != x.device:
                self._magnitude = torch.empty(need, dtype=torch.float32, device=x.device)
            pieces += [g.encode(x, payload, self._magnitude) for g in self.groups]
        for i in self.alone:
            span, shape = self.elements[i], self.shapes[i]
            sent = self.compressor.encode_sent(span.of(x).view(shape), self.payloads[i].of(payload), step)
            positions = None if sent.positions is None else sent.positions + span.start
            pieces.append(Piece((i,), (0, sent.values.numel()), positions, sent.values.reshape(-1)))
        return pieces

    def mean(self, rows: Sequence[torch.Tensor], step: int, mode: str, out: torch.Tensor,
             own: tuple[int, list[Piece]] | None = None) -> torch.Tensor:
        """Δ̄ into `out` (flat float32, `numel`): the ranks' decoded tensors averaged as
        `ChunkedTopK.aggregate` averages them, from each rank's payload in `rows` (rank order),
        summed in rank order. own = (rank, its `encode` pieces): that row is not read again."""
        out.zero_()
        counts = self._counts(out) if mode == "senders" else None
        for gi, group in enumerate(self.groups):
            for r, row in enumerate(rows):
                piece = own[1][gi] if own is not None and r == own[0] else group.read(row)
                out.index_add_(0, piece.positions, piece.values)
                if counts is not None:
                    counts.index_add_(0, piece.positions, torch.ones_like(piece.values))
        if self.groups:
            out.div_(len(rows) if counts is None else counts.clamp_(min=1))
        for i in self.alone:                                       # on their own: as the per-tensor path does
            self.elements[i].of(out).view(self.shapes[i]).copy_(self._alone_mean(i, rows, step, mode))
        return out

    def _alone_mean(self, i: int, rows: Sequence[torch.Tensor], step: int, mode: str) -> torch.Tensor:
        comp, shape = self.compressor, self.shapes[i]
        spec = comp.payload_spec(shape)
        reads = [comp.read(Payload.from_buffer(self.payloads[i].of(row), spec), shape) for row in rows]
        padded = comp.plan(shape).padded_numel
        buf = comp.scratch(2 * padded, reads[0][1].device)
        return comp.aggregate(reads, shape, step, mode, out=buf[:padded], scratch=buf[padded:])

    def _counts(self, like: torch.Tensor) -> torch.Tensor:
        if self._count_buf is None or self._count_buf.numel() != like.numel():
            self._count_buf = torch.empty_like(like)
        return self._count_buf.zero_()
