"""SparseLoCo's compressor over a whole layout in a few batched operations (`GroupedSparseLoCo`),
the bytes of every tensor those `SparseLoCoTopK.encode` writes for it alone.

A tensor joins when its top-k is on the values ('identity') and its values are '2bit' or
'8bit' (the statistical quantizer with 4 or 256 levels per tensor, `PER_TENSOR_VALUES`); the
others (`alone`) are the caller's, tensor by tensor. The joined tensors are cut by chunk
shape (h, w) into families (h, w fix E = h·w, k and the index coding), and a family by
column count into stacks (tensors of one (h, w, cols) stack on their rows: the chunk-major
order of the stack is each tensor's, one after the other). A tensor whose chunks pad is a
stack of its own: its zero-padded image, kept whole (only the inside is written), as
`SparseLoCoTopK` pads it; what top-k keeps in the padding travels and is quantized as
there, and lands nowhere (`padding`: position 0, adding ±0.0).
Every value lives in the caller's flat float32 buffer of the layout (tensor i at `offsets[i]`),
and the kept values of all joined tensors in one flat buffer of K values, family by family,
a tensor's C·k values together (`segment`: each kept value's tensor). A sync is then

    select   per stack one copy into the stage and one |·| chunk-major, per family one
             top-k and one computation of the kept values' flat positions in the layout
    encode   one take of the kept values, one quantization of all of them with levels
             per tensor (`quantize_segments`), one packing per index stream and family and
             one of all the codes, one scatter of the bytes into the message (`MessageMap`)
    read     one take of every rank's bytes, one unpacking per stream, one check of all
             (on the device: `flags`), [W, K] positions and values

Same results as `FlatSparseLoCo` (tests/compress/test_sparseloco_grouped.py): the same
top-k calls over the same magnitudes (more rows per call), the same elementwise arithmetic;
the per-tensor sums of the quantizer's statistics run in element order (`quantize_segments`).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from ..ops.select import ascending, largest_indices
from ..wire import checks
from ..wire.shares import MessageMap, ShareStream
from ..wire.spans import spans
from ..wire.twobit import LEVELS, Segments, quantize_segments
from .sparseloco_topk import PER_TENSOR_VALUES, SparseLoCoTopK


def joins(comp: SparseLoCoTopK, shape) -> bool:
    """Whether a tensor of `shape` can take the grouped path (module docstring)."""
    return comp.transform.kind == "identity" and comp.codec.name in PER_TENSOR_VALUES


class _Family:
    """Joined tensors of one chunk shape: `members` (layout indices, stack by stack), their
    G chunks as rows, kept values [kept], the unpadded ones' elements staged at [staged, ...)."""

    def __init__(self, comp: SparseLoCoTopK, shapes, offsets, members: list[int], kept: int, staged: int, device):
        plans = {i: comp.plan(shapes[i]) for i in members}
        # stack keys: None (chunk-major is row-major), cols, or ("pad", i): a padded tensor's own image
        stacks: dict = {None: []}
        for i in members:
            plan = plans[i]
            key = ("pad", i) if plan.padded else None if plan.chunk_rows == 1 or plan.grid[1] == 1 else plan.cols
            stacks.setdefault(key, []).append(i)
        self.members = [i for js in stacks.values() for i in js]
        first = plans[self.members[0]]
        self.h, self.w, self.k = first.chunk_rows, first.chunk_cols, comp.k(first.shape)
        self.coding = comp.coding(first.shape)
        self.chunks = [plans[i].num_chunks for i in self.members]
        self.rows = sum(self.chunks)
        self.kept = slice(kept, kept + self.rows * self.k)
        self.views = [(offsets[i], _numel(shapes[i]), plans[i]) for i in self.members]   # (start, numel, plan)
        unpadded = sum(n for _, n, plan in self.views if not plan.padded)
        self.staged, self.stacks = slice(staged, staged + unpadded), []
        at, row = 0, 0
        for key, js in stacks.items():
            if not js:
                continue
            chunks = sum(plans[i].num_chunks for i in js)
            if isinstance(key, tuple):                  # [R', C'] zeros once: only the inside is written
                plan = plans[key[1]]
                image = torch.zeros(plan.padded_rows, plan.padded_cols, device=device)
                self.stacks.append((plan.padded_cols, image, row, self.members.index(key[1])))
            else:
                numel = sum(_numel(shapes[i]) for i in js)
                self.stacks.append((key, slice(at, at + numel), row, None))
                at += numel
            row += chunks
        self._place(offsets, device)
        self.magnitude = torch.empty(self.rows, self.h * self.w, device=device)
        self.idx: torch.Tensor | None = None                                   # [G, k] this sync's chunk-local indices

    def _place(self, offsets, device) -> None:
        """Per chunk [G, 1]: its (0, 0)'s flat position in the layout (offset + a·h·cols + b·w),
        cols − w, and (padded members) the rows and columns left inside from its (0, 0)."""
        origins, cols, inside = [], [], []
        for (start, _, plan) in self.views:
            (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
            a, b = torch.arange(gr)[:, None], torch.arange(gc)[None, :]
            origins.append((start + a * (h * plan.cols) + b * w).view(-1))
            cols.append(torch.full((gr * gc,), plan.cols))
            inside.append(torch.stack([(plan.rows - a * h).expand(gr, gc), (plan.cols - b * w).expand(gr, gc)], -1).view(-1, 2))
        self.origin = torch.cat(origins).view(-1, 1).to(device)                # [G, 1]
        self.skip = (torch.cat(cols).view(-1, 1) - self.w).to(device)          # cols − w  [G, 1]
        self.padded = any(plan.padded for _, _, plan in self.views)
        inside = torch.cat(inside).to(device)                                  # [G, 2]
        self.rows_in, self.cols_in = inside[:, :1].contiguous(), inside[:, 1:].contiguous()

    def positions(self, idx: torch.Tensor, out: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk-local indices [..., G, k] -> flat positions in the layout: with u = idx // w,
        (idx − u·w) + u·cols + origin = idx + u·(cols − w) + origin. A family with padded
        members also marks in `padding` the indices that lie in a padding (their position: 0)."""
        u = torch.div(idx, self.w, rounding_mode="floor")
        if self.padded:
            # padding: u >= rows left, or v = idx − u·w >= cols left
            torch.ge(u, self.rows_in, out=padding)
            padding.logical_or_(torch.sub(idx, u * self.w).ge_(self.cols_in))
        torch.add(u.mul_(self.skip), self.origin, out=out).add_(idx)
        return out.masked_fill_(padding, 0) if self.padded else out

    def select(self, x: torch.Tensor, stage: torch.Tensor, out: torch.Tensor, padding: torch.Tensor | None) -> None:
        """|x| chunk-major for every member, one top-k, the kept positions into out [G, k]."""
        h, w = self.h, self.w
        views = [x[start: start + n] for start, n, plan in self.views if not plan.padded]
        # the unpadded members' elements, row-major, one after the other
        image = torch.cat(views, out=stage[self.staged]) if len(views) > 1 else views[0] if views else None
        magnitude = self.magnitude.view(-1)
        for cols, source, row, j in self.stacks:
            if j is not None:                                                    # a padded member's image
                start, n, plan = self.views[j]
                source[: plan.rows, : plan.cols].copy_(x[start: start + n].view(plan.rows, plan.cols))
                part = source.view(-1)
            else:
                part = image[source]
            rows_out = magnitude[row * h * w: row * h * w + part.numel()]
            if cols is None:                                                      # chunk-major is row-major
                torch.abs(part, out=rows_out)
                continue
            grid = (part.numel() // (h * cols), cols // w)
            # [ΣR, cols] -> [ΣR/h, h, cols/w, w] -> [ΣR/h, cols/w, h, w]: chunk-major, one strided pass
            torch.abs(part.view(grid[0], h, grid[1], w).permute(0, 2, 1, 3), out=rows_out.view(grid[0], grid[1], h, w))
        idx = largest_indices(self.magnitude, self.k)
        self.idx = ascending(idx, h * w) if self.coding.sorted else idx
        self.positions(self.idx, out, padding)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class GroupedSparseLoCo:
    """`SparseLoCoTopK` over the tensors of `shapes` (float32 values in one flat buffer, tensor
    i at element `offsets`[i]), their payloads end to end in one uint8 buffer (module docstring)."""

    def __init__(self, comp: SparseLoCoTopK, shapes: Sequence[tuple[int, ...]], device,
                 eligible: Sequence[bool] | None = None):
        """eligible: per tensor, whether the caller lets it join at all (default: every one)."""
        self.comp, self.shapes, self.device = comp, [tuple(s) for s in shapes], torch.device(device)
        self.eligible = [True] * len(self.shapes) if eligible is None else list(eligible)
        # L levels per tensor and bits per code of the quantizer (2-bit's when no tensor can join)
        statistical = comp.codec.name in PER_TENSOR_VALUES
        self.L, self.bits = (comp.codec.levels, comp.codec.bits) if statistical else (LEVELS, 2)
        self.level_bytes = 4 * self.L
        self.offsets = [s.start for s in spans(_numel(s) for s in self.shapes)]
        self.payloads = spans(comp.payload_nbytes(s) for s in self.shapes)
        by_shape: dict[tuple[int, int], list[int]] = {}                      # (h, w) -> layout indices
        for i, shape in enumerate(self.shapes):
            if self.eligible[i] and joins(comp, shape):
                plan = comp.plan(shape)
                by_shape.setdefault((plan.chunk_rows, plan.chunk_cols), []).append(i)
        self.alone = [i for i, s in enumerate(self.shapes) if not (self.eligible[i] and joins(comp, s))]
        self.families, kept, staged = [], 0, 0
        for members in by_shape.values():
            self.families.append(_Family(comp, self.shapes, self.offsets, members, kept, staged, device))
            kept, staged = kept + self.families[-1].rows * self.families[-1].k, self.families[-1].staged.stop
        self.tensors = [i for f in self.families for i in f.members]                 # kept order
        lengths = [c * f.k for f in self.families for c in f.chunks]                  # C·k per tensor
        self.kept = kept
        self.segment = Segments(lengths, device, self.L)                          # each kept value's tensor
        self.positions = torch.empty(kept, dtype=torch.int64, device=device)       # this sync's kept positions
        # which kept values lie in a padding (families with padded members; None: none can)
        self.padding = torch.zeros(kept, dtype=torch.bool, device=device) if any(f.padded for f in self.families) else None
        self.received_padding: torch.Tensor | None = None                          # [W, K], the last `read`'s
        self.map = self._map(lengths)

    @property
    def nbytes(self) -> int:
        return self.payloads[-1].stop if self.payloads else 0

    def _map(self, lengths: list[int]) -> MessageMap:
        """The joined tensors' bytes: levels (raw), each family's index streams, the codes."""
        index_bytes = {i: self.comp.coding(self.shapes[i]).nbytes(self.comp.plan(self.shapes[i]).num_chunks)
                       for i in self.tensors}
        streams = []
        for f in self.families:
            at = {i: self.payloads[i].start for i in f.members}                      # each member's next stream
            for m, bits, flags in f.coding.streams:
                counts = [c * m for c in f.chunks]
                streams.append(ShareStream(counts, bits, flags, [at[i] for i in f.members], self.device))
                for i, n in zip(f.members, counts):
                    at[i] += -(-n * bits // 8)
        code_places = [self.payloads[i].start + index_bytes[i] + self.level_bytes for i in self.tensors]
        streams.append(ShareStream(lengths, self.bits, False, code_places, self.device))
        level_places = [self.payloads[i].start + index_bytes[i] for i in self.tensors]
        return MessageMap([(self.level_bytes, level_places)], streams, self.nbytes, self.device)

    def select(self, x: torch.Tensor, stage: torch.Tensor) -> None:
        """Every joined tensor's top-k of |x| (x: the layout's flat float32 values; stage: a flat
        float32 scratch of x's size)."""
        for f in self.families:
            padding = self.padding[f.kept].view(f.rows, f.k) if f.padded else None
            f.select(x, stage, self.positions[f.kept].view(f.rows, f.k), padding)

    def encode(self, x: torch.Tensor, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After `select`: the joined tensors' bytes into `message` (the payloads, end to end);
        returns (positions [K] in the layout, the values every receiver decodes [K])."""
        if not self.tensors:
            return self.positions, x.new_empty(0)
        values = x.take(self.positions)                                           # [K] the kept values
        if self.padding is not None:                                              # the padding's zeros, as the image's
            values.masked_fill_(self.padding, 0.0)
        q, levels = quantize_segments(values, self.segment)
        self.map.raw_out(0, levels.numel() * 4).copy_(levels.view(-1).view(torch.uint8))
        s = 0
        for f in self.families:
            for part in f.coding.split(f.idx):
                self.map.streams[s].pack(part, self.map.stream_out(s))
                s += 1
        self.map.streams[s].pack(q, self.map.stream_out(s))
        self.map.write(message)
        # x̂ = t_q, as the codec decodes it
        sent = levels.view(-1).take(q.add_(self.segment.level_of))
        if self.padding is not None:                 # receivers crop the padding: 0 at position 0, subtracted exactly
            sent.masked_fill_(self.padding, 0.0)
        return self.positions, sent

    def read(self, messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Every rank's message [W, nbytes] -> (positions [W, K] in the layout, values [W, K],
        0-dim bool flags of malformed bytes: indices past a chunk (clamped), non-finite values).
        A value in a padding is −0.0 at position 0 (x + (−0.0) = x: it adds nothing);
        `received_padding` [W, K] marks them (None when no family has padded members)."""
        world = messages.shape[0]
        if not self.tensors:
            return self.positions.expand(world, 0), messages.new_empty(world, 0, dtype=torch.float32), []
        got, flags = self.map.read(messages), []
        T = len(self.tensors)
        levels = got[: world * T * self.level_bytes].view(torch.float32).view(world, T * self.L)    # [W, L·T]
        positions = torch.empty(world, self.kept, dtype=torch.int64, device=messages.device)
        padding = self.received_padding = None if self.padding is None else torch.zeros(
            world, self.kept, dtype=torch.bool, device=messages.device)
        s = 0
        for f in self.families:
            parts = []
            for m, _, _ in f.coding.streams:
                parts.append(self._unpack(got, s, world).reshape(world * f.rows, m))   # [W·G, m]
                s += 1
            idx, bad = f.coding.join_flagged(parts, world * f.rows)
            flags += [bad] if bad is not None else []
            # [W·G, k] -> [W, G, k]: each rank's chunks against the family's chunk origins
            f.positions(idx.view(world, f.rows, f.k), positions[:, f.kept].view(world, f.rows, f.k),
                        padding[:, f.kept].view(world, f.rows, f.k) if f.padded else None)
        codes = self._unpack(got, s, world).add_(self.segment.level_of)                   # [W, K]: L · tensor + q
        values = levels.gather(1, codes)
        flags.append(checks.nonfinite(values))
        return positions, values if padding is None else values.masked_fill_(padding, -0.0), flags

    def _unpack(self, got: torch.Tensor, s: int, world: int) -> torch.Tensor:
        stream, at = self.map.streams[s], self.map.stream_at[s] * world
        return stream.unpack(got[at: at + world * stream.nbytes], world)
