"""SparseLoCo's compressor over the tensors of a layout (`FlatSparseLoCo`): the bytes of every
tensor are what `SparseLoCoTopK.encode` writes for it alone, and a receiver decodes the same
values, with fewer tensor operations per tensor.

The work that reads or writes a whole tensor stays tensor by tensor, so it runs while that
tensor is in cache: |x| in chunk-major order, the kept values, their codes and levels
(one set per tensor, as the paper has it), and what the caller does with them (e' = e − Δ̂,
the eager jump; at the landing the mean, θ₀ and the rejoin). What only touches the kept values
and the bytes is done once for a group of tensors that share a chunk geometry (h, w, k), are
unpadded, and take 'identity' top-k with '2bit' or '8bit' values (a model's matrices usually
form one group, its vectors another):

    select   when the caller `stage`s every tensor's |x| first (SparseLoCo does), the chunks'
             top-k and Elias-Fano's ascending sort in one call each over all the group's
             chunks (else `encode` selects tensor by tensor; the same indices either way)
    encode   every member's chunk-local indices (each chunk's ascending for 'elias-fano') and
             codes kept in [G, k] buffers (G: the group's chunks), then one packing of each of
             the indices' bit streams (`thinwire.wire.indices`: one for 'packed'; lows and
             bitmaps for 'elias-fano') and one of the codes when every member's share of each
             ends on a byte (else one per member), copied into each member's payload beside
             its level bytes (16 for '2bit', 1024 for '8bit')
    read     one unpacking of each (or one per member), one check of the indices and of the
             decoded values, the flat positions of every chunk's values at once

Any other tensor (padded, 'dct', other value formats) is encoded and averaged by
`SparseLoCoTopK` on its own.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from ..ops.select import ascending, largest_indices
from ..wire.spans import Span, spans
from ..wire import pack_bits, packed_nbytes, unpack_bits
from ..wire.indices import pack_stream, unpack_stream
from ..wire.twobit import quantize_rows
from .payload import Payload
from .sparseloco_topk import PER_TENSOR_VALUES, Sent, SparseLoCoTopK

Decoded = tuple[torch.Tensor, torch.Tensor]    # (flat positions in the tensor [n] int64, values [n] float32)


class _Group:
    """Tensors sharing (h, w, k), their G chunks as the rows of [G, k] buffers."""

    def __init__(self, members: list[int], plans, payloads: list[Span], compressor: SparseLoCoTopK, device):
        self.members, self.plans, self.payloads = members, plans, payloads
        self.h, self.w, self.k = plans[0].chunk_rows, plans[0].chunk_cols, compressor.k(plans[0].shape)
        self.coding = compressor.coding(plans[0].shape)
        # L levels of `bits`-bit codes per tensor, 4·L bytes of float32 levels
        self.L, self.bits = compressor.codec.levels, compressor.codec.bits
        self.level_bytes = 4 * self.L
        self.chunks = [p.num_chunks for p in plans]
        self.first = list(accumulate(self.chunks, initial=0))                   # member j's rows: first[j]..first[j+1]
        self.rows = self.first[-1]
        # per index stream s (member j's bytes of it: c_j·m_s values of bits_s), and the codes
        self.stream_bytes = [[packed_nbytes(c * m, bits) for c in self.chunks] for m, bits, _ in self.coding.streams]
        self.stream_at = [list(accumulate(sizes, initial=0)) for sizes in self.stream_bytes]
        self.index_bytes = [self.coding.nbytes(c) for c in self.chunks]
        self.code_bytes = [packed_nbytes(c * self.k, self.bits) for c in self.chunks]
        self.code_at = list(accumulate(self.code_bytes, initial=0))
        self.aligned = all(c * m * bits % 8 == 0 and c * self.k * self.bits % 8 == 0
                           for c in self.chunks for m, bits, _ in self.coding.streams)
        # per chunk: the flat position of its (0, 0) in its tensor, and that tensor's columns  [G, 1]
        origins, cols = [], []
        for plan in plans:
            (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
            origins.append((torch.arange(gr)[:, None] * (h * plan.cols) + torch.arange(gc)[None, :] * w).view(-1))
            cols.append(torch.full((gr * gc,), plan.cols))
        self.origin = torch.cat(origins).view(-1, 1).to(device)
        self.cols = torch.cat(cols).view(-1, 1).to(device)
        self.tensor_of_row = torch.repeat_interleave(torch.arange(len(plans)), torch.tensor(self.chunks)).to(device)
        self.idx = torch.empty(self.rows, self.k, dtype=torch.int64, device=device)    # this rank's, until written
        self.codes = torch.empty(self.rows, self.k, dtype=torch.int64, device=device)
        self.levels = torch.empty(len(members), self.L, device=device)
        self.magnitude: torch.Tensor | None = None    # [G, h·w] staged |x|, chunk-major (`stage`)
        self.selected: torch.Tensor | None = None     # [G, k] flat positions of `select`'s top-k, until written

    def positions(self, idx: torch.Tensor, rows: slice) -> torch.Tensor:
        """Chunk-local indices [n, k] of the chunks `rows` -> flat positions in their tensors: u·cols + v + origin."""
        u = torch.div(idx, self.w, rounding_mode="floor")
        return (idx - u * self.w).add_(u * self.cols[rows]).add_(self.origin[rows])

    def _chunk_major(self, j: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """|x| of member j chunk-major into out ([C, h·w]): [R, C] -> [gr, h, gc, w] -> [gr, gc, h, w],
        one strided pass."""
        (gr, gc), h, w = self.plans[j].grid, self.h, self.w
        torch.abs(x.view(gr, h, gc, w).permute(0, 2, 1, 3), out=out.view(gr, gc, h, w))
        return out

    def _top(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Each chunk's top-k [n, k] of its magnitudes [n, h·w], ascending if the coding sorts."""
        idx = largest_indices(magnitude, self.k)
        return ascending(idx, self.h * self.w) if self.coding.sorted else idx

    def stage(self, j: int, x: torch.Tensor) -> None:
        """Member j's |x| into the group's magnitudes, for one `select` over every member."""
        if self.magnitude is None or self.magnitude.device != x.device:
            self.magnitude = torch.empty(self.rows, self.h * self.w, device=x.device)
        self._chunk_major(j, x, self.magnitude[self.first[j]: self.first[j + 1]])

    def select(self) -> None:
        """Every member's top-k from the staged magnitudes: one selection and one sort over all
        the group's chunks (on `wan`'s 15 tensors 15.5 ms a sync against 17.3 one by one)."""
        self.idx.copy_(self._top(self.magnitude))
        self.selected = self.positions(self.idx, slice(None))                  # [G, k]

    def encode(self, j: int, x: torch.Tensor, magnitude: torch.Tensor) -> Sent:
        """Member j's top-k (`select`'s when the group was selected, else its own now), codes and
        levels from x (float32, contiguous, its shape), kept for `write`; what receivers decode
        of them. `magnitude`: flat float32 scratch >= x.numel()."""
        rows = slice(self.first[j], self.first[j + 1])
        if self.selected is not None:                                           # its rows of self.idx: select's
            positions = self.selected[rows].view(-1)                            # [C·k]
        else:
            idx = self._top(self._chunk_major(j, x, magnitude[: x.numel()].view(-1, self.h * self.w)))   # [C, k]
            self.idx[rows] = idx
            positions = self.positions(idx, rows).view(-1)                      # [C·k]
        # the kept values (index_select: about 2x torch.take's speed on CPU here), one row: the tensor's
        q, levels = quantize_rows(x.view(-1).index_select(0, positions).view(1, -1), self.L)
        self.codes[rows], self.levels[j] = q.view(-1, self.k), levels[0]
        # x̂ = t_q, as the codec decodes it
        return Sent(positions, levels.view(-1).take(q.view(-1)), None)

    def write(self, payload: torch.Tensor) -> None:
        """Every member's indices, levels and codes into its payload span (a selection ends here)."""
        self.selected = None
        level_bytes, nl = self.levels.view(torch.uint8).view(-1, self.level_bytes), self.level_bytes
        if self.aligned:
            index_streams = [pack_stream(part, bits) for part, (_, bits, _) in zip(self.coding.split(self.idx),
                                                                                    self.coding.streams)]
            code_stream = pack_bits(self.codes, self.bits)
        for j, span in enumerate(self.payloads):
            out, ni = span.of(payload), self.index_bytes[j]
            a, b = self.first[j], self.first[j + 1]
            if self.aligned:
                at = 0
                for stream, starts in zip(index_streams, self.stream_at):
                    out[at: at + starts[j + 1] - starts[j]].copy_(stream[starts[j]: starts[j + 1]])
                    at += starts[j + 1] - starts[j]
                out[ni + nl:].copy_(code_stream[self.code_at[j]: self.code_at[j + 1]])
            else:
                self.coding.pack(self.idx[a:b], out=out[:ni])
                pack_bits(self.codes[a:b], self.bits, out=out[ni + nl:])
            out[ni: ni + nl].copy_(level_bytes[j])

    def read(self, payload: torch.Tensor) -> list[Decoded]:
        """One rank's bytes of this group -> each member's (positions, values), validated as
        `SparseLoCoTopK.read` validates them."""
        parts = [span.of(payload) for span in self.payloads]
        index_parts = [b[:n] for b, n in zip(parts, self.index_bytes)]
        nl = self.level_bytes
        code_parts = [b[n + nl:] for b, n in zip(parts, self.index_bytes)]
        count = self.rows * self.k
        if self.aligned:
            streams = [torch.cat(_stream_parts(index_parts, s, self.stream_bytes)) for s in range(len(self.stream_bytes))]
            idx = self.coding.join([unpack_stream(b, bits, self.rows * m, flags)
                                    for b, (m, bits, flags) in zip(streams, self.coding.streams)], self.rows)
            q = unpack_bits(torch.cat(code_parts), self.bits, count)
        else:
            idx = torch.cat([self.coding.unpack(b, c) for b, c in zip(index_parts, self.chunks)])
            q = torch.cat([unpack_bits(b, self.bits, c * self.k) for b, c in zip(code_parts, self.chunks)])
        levels = torch.cat([b[n: n + nl] for b, n in zip(parts, self.index_bytes)]).view(torch.float32)
        values = levels.take(q.view(self.rows, self.k) + self.L * self.tensor_of_row.unsqueeze(1))   # [G, k]
        if not bool(torch.isfinite(values).all()):
            raise ValueError("malformed payload: non-finite values")
        positions = self.positions(idx.view(self.rows, self.k), slice(None))
        return [(positions[a:b].view(-1), values[a:b].view(-1)) for a, b in zip(self.first, self.first[1:])]


def _stream_parts(index_parts: list[torch.Tensor], s: int, sizes: list[list[int]]) -> list[torch.Tensor]:
    """Each member's bytes of index stream s: its index part holds streams 0..s-1 first."""
    return [part[sum(sizes_j[:s]): sum(sizes_j[: s + 1])] for part, sizes_j in zip(index_parts, zip(*sizes))]


class FlatSparseLoCo:
    """`SparseLoCoTopK` over the tensors of these shapes, their payloads end to end in one
    uint8 buffer (the module docstring). A sync: `encode(i, ...)` for every tensor, then
    `write`; a landing: `decode` once, then `mean(i, ...)` for every tensor."""

    def __init__(self, compressor: SparseLoCoTopK, shapes: Sequence[tuple[int, ...]], device):
        self.compressor, self.shapes, self.device = compressor, [tuple(s) for s in shapes], torch.device(device)
        self.payloads = spans(compressor.payload_nbytes(s) for s in self.shapes)
        self.place: dict[int, tuple[_Group, int]] = {}                         # tensor -> (its group, member j)
        geometry: dict[tuple[int, int, int], list[int]] = {}
        for i, shape in enumerate(self.shapes):
            plan = compressor.plan(shape)
            if (compressor.transform.kind == "identity" and compressor.codec.name in PER_TENSOR_VALUES
                    and not plan.padded):
                geometry.setdefault((plan.chunk_rows, plan.chunk_cols, compressor.k(shape)), []).append(i)
        self.groups = []
        for members in geometry.values():
            group = _Group(members, [compressor.plan(self.shapes[i]) for i in members],
                           [self.payloads[i] for i in members], compressor, device)
            self.groups.append(group)
            self.place.update({i: (group, j) for j, i in enumerate(members)})
        self.alone = [i for i in range(len(self.shapes)) if i not in self.place]

    @property
    def nbytes(self) -> int:
        return self.payloads[-1].stop if self.payloads else 0

    def stage(self, i: int, x: torch.Tensor) -> None:
        """Tensor i's magnitudes for `select` (nothing for a tensor on its own)."""
        if i in self.place:
            group, j = self.place[i]
            group.stage(j, x)

    def select(self) -> None:
        """Every group's top-k at once, after every grouped tensor was staged; `encode` then
        takes it, until `write`."""
        for group in self.groups:
            group.select()

    def encode(self, i: int, x: torch.Tensor, payload: torch.Tensor, step: int = 0) -> Sent:
        """Tensor i (x: float32, contiguous): its top-k and values, kept for `write` (a tensor on
        its own: its bytes written now); what receivers decode of them, as `encode_sent`."""
        if i not in self.place:
            return self.compressor.encode_sent(x, self.payloads[i].of(payload), step)
        group, j = self.place[i]
        return group.encode(j, x, self.compressor.scratch(x.numel(), x.device))

    def write(self, payload: torch.Tensor) -> None:
        """The grouped tensors' bytes, after every one of them was encoded."""
        for group in self.groups:
            group.write(payload)

    def decode(self, rows: Sequence[torch.Tensor], own: tuple[int, dict[int, Sent]] | None = None):
        """Every rank's payload (rank order) -> per rank, tensor -> (positions, values) for the
        grouped tensors, validated. own = (rank, its `encode` results): that row is not read."""
        decoded = []
        for r, row in enumerate(rows):
            if own is not None and r == own[0]:
                decoded.append({i: (own[1][i].positions, own[1][i].values) for i in self.place})
                continue
            mine = {}
            for group in self.groups:
                mine.update(zip(group.members, group.read(row)))
            decoded.append(mine)
        return decoded

    def mean(self, i: int, decoded, rows: Sequence[torch.Tensor], step: int, mode: str,
             out: torch.Tensor) -> torch.Tensor:
        """Δ̄ of tensor i into `out` (float32, contiguous, its shape), as `ChunkedTopK.aggregate`
        averages it: the ranks' decoded values summed in rank order, then divided."""
        if i not in self.place:
            return out.copy_(self._alone_mean(i, rows, step, mode))
        flat = out.view(-1).zero_()
        for mine in decoded:
            flat.index_add_(0, *mine[i])
        if mode == "mean":
            return out.div_(len(decoded))
        counts = self.compressor.scratch(flat.numel(), flat.device)[: flat.numel()].zero_()
        for mine in decoded:
            counts.index_add_(0, mine[i][0], torch.ones_like(mine[i][1]))
        return out.div_(counts.clamp_(min=1).view(out.shape))

    def _alone_mean(self, i: int, rows: Sequence[torch.Tensor], step: int, mode: str) -> torch.Tensor:
        return alone_mean(self.compressor, self.shapes[i], self.payloads[i], rows, step, mode)


def alone_mean(comp: SparseLoCoTopK, shape, payload: Span, rows: Sequence[torch.Tensor], step: int,
               mode: str) -> torch.Tensor:
    """Δ̄ of one tensor on its own (`SparseLoCoTopK.read` of every row, then `aggregate`), in
    the compressor's scratch: its bytes at `payload` of each row."""
    spec = comp.payload_spec(shape)
    reads = [comp.read(Payload.from_buffer(payload.of(row), spec), shape) for row in rows]
    padded = comp.plan(shape).padded_numel
    buf = comp.scratch(2 * padded, reads[0][1].device)
    return comp.aggregate(reads, shape, step, mode, out=buf[:padded], scratch=buf[padded:])
