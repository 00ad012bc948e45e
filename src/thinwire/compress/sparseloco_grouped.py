"""SparseLoCo's compressor over a whole layout in a few batched operations (`GroupedSparseLoCo`),
the bytes of every tensor those `SparseLoCoTopK.encode` writes for it alone.

A tensor joins when its top-k is on the values ('identity'), its values are '2bit' and its
chunks pad nothing; the others (`alone`) are the caller's, tensor by tensor. The joined
tensors are cut by chunk shape (h, w) into families (h, w fix E = h·w, k and the index
coding), and a family by column count into stacks (tensors of one (h, w, cols) stack on
their rows: the chunk-major order of the stack is each tensor's, one after the other).
Every value lives in the caller's flat float32 buffer of the layout (tensor i at `offsets[i]`),
and the kept values of all joined tensors in one flat buffer of K values, family by family,
a tensor's C·k values together (`segment`: each kept value's tensor). A sync is then

    select   per stack one copy into the stage and one |·| chunk-major, per family one
             top-k and one computation of the kept values' flat positions in the layout
    encode   one take of the kept values, one 2-bit quantization of all of them with levels
             per tensor (`quantize_segments`), one packing per index stream and family and
             one of all the codes, one scatter of the bytes into the message (`MessageMap`)
    read     one take of every rank's bytes, one unpacking per stream, one check of all
             (on the device: `flags`), [W, K] positions and values

Same results as `FlatSparseLoCo` (tests/compress/test_sparseloco_grouped.py): the same
top-k calls over the same magnitudes (more rows per call), the same elementwise arithmetic;
the per-tensor sums of the 2-bit statistics run in element order (`quantize_segments`).
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
from .sparseloco_topk import SparseLoCoTopK

LEVEL_BYTES = 4 * LEVELS


def joins(comp: SparseLoCoTopK, shape) -> bool:
    """Whether a tensor of `shape` can take the grouped path (module docstring)."""
    return comp.transform.kind == "identity" and comp.codec.name == "2bit" and not comp.plan(shape).padded


class _Family:
    """Joined tensors of one chunk shape: `members` (layout indices, stack by stack), their
    G chunks as rows, kept values [kept], their elements staged at [staged, staged + numel)."""

    def __init__(self, comp: SparseLoCoTopK, shapes, offsets, members: list[int], kept: int, staged: int, device):
        stacks: dict[int | None, list[int]] = {None: []}        # cols -> members; None: chunk-major is row-major
        for i in members:
            plan = comp.plan(shapes[i])
            stacks.setdefault(None if plan.chunk_rows == 1 or plan.grid[1] == 1 else plan.cols, []).append(i)
        self.members = [i for js in stacks.values() for i in js]
        plans = [comp.plan(shapes[i]) for i in self.members]
        self.h, self.w, self.k = plans[0].chunk_rows, plans[0].chunk_cols, comp.k(plans[0].shape)
        self.coding = comp.coding(plans[0].shape)
        self.chunks = [p.num_chunks for p in plans]
        self.rows = sum(self.chunks)
        self.kept = slice(kept, kept + self.rows * self.k)
        self.views = [(offsets[i], plan.rows * plan.cols) for i, plan in zip(self.members, plans)]   # (start, numel)
        self.staged = slice(staged, staged + sum(n for _, n in self.views))
        # (cols or None, its first element in the stage, its elements, its first chunk row)
        self.stacks, at, row = [], 0, 0
        for cols, js in stacks.items():
            numel, chunks = sum(_numel(shapes[i]) for i in js), sum(comp.plan(shapes[i]).num_chunks for i in js)
            if js:
                self.stacks.append((cols, at, numel, row))
            at, row = at + numel, row + chunks
        origins, cols = [], []
        for i, plan in zip(self.members, plans):
            (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
            # chunk (a, b)'s (0, 0) in the layout: offset + a·h·cols + b·w   [gr·gc]
            origins.append((offsets[i] + torch.arange(gr)[:, None] * (h * plan.cols) + torch.arange(gc)[None, :] * w).view(-1))
            cols.append(torch.full((gr * gc,), plan.cols))
        self.origin = torch.cat(origins).view(-1, 1).to(device)                # [G, 1]
        self.skip = (torch.cat(cols).view(-1, 1) - self.w).to(device)          # cols − w  [G, 1]
        self.magnitude = torch.empty(self.rows, self.h * self.w, device=device)
        self.idx: torch.Tensor | None = None                                   # [G, k] this sync's chunk-local indices

    def positions(self, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Chunk-local indices [..., G, k] -> flat positions in the layout: with u = idx // w,
        (idx − u·w) + u·cols + origin = idx + u·(cols − w) + origin."""
        u = torch.div(idx, self.w, rounding_mode="floor")
        return torch.add(u.mul_(self.skip), self.origin, out=out).add_(idx)

    def select(self, x: torch.Tensor, stage: torch.Tensor, out: torch.Tensor) -> None:
        """|x| chunk-major for every member, one top-k, the kept positions into out [G, k]."""
        h, w = self.h, self.w
        views = [x[start: start + n] for start, n in self.views]
        # every member's elements, row-major, one after the other
        image = torch.cat(views, out=stage[self.staged]) if len(views) > 1 else views[0]
        magnitude = self.magnitude.view(-1)
        for cols, at, numel, row in self.stacks:
            part, rows_out = image[at: at + numel], magnitude[row * h * w: row * h * w + numel]
            if cols is None:                                                      # chunk-major is row-major
                torch.abs(part, out=rows_out)
                continue
            grid = (numel // (h * cols), cols // w)
            # [ΣR, cols] -> [ΣR/h, h, cols/w, w] -> [ΣR/h, cols/w, h, w]: chunk-major, one strided pass
            torch.abs(part.view(grid[0], h, grid[1], w).permute(0, 2, 1, 3), out=rows_out.view(grid[0], grid[1], h, w))
        idx = largest_indices(self.magnitude, self.k)
        self.idx = ascending(idx, h * w) if self.coding.sorted else idx
        self.positions(self.idx, out)


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
        self.segment = Segments(lengths, device)                                  # each kept value's tensor
        self.positions = torch.empty(kept, dtype=torch.int64, device=device)       # this sync's kept positions
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
        code_places = [self.payloads[i].start + index_bytes[i] + LEVEL_BYTES for i in self.tensors]
        streams.append(ShareStream(lengths, 2, False, code_places, self.device))
        level_places = [self.payloads[i].start + index_bytes[i] for i in self.tensors]
        return MessageMap([(LEVEL_BYTES, level_places)], streams, self.nbytes, self.device)

    def select(self, x: torch.Tensor, stage: torch.Tensor) -> None:
        """Every joined tensor's top-k of |x| (x: the layout's flat float32 values; stage: a flat
        float32 scratch of x's size)."""
        for f in self.families:
            f.select(x, stage, self.positions[f.kept].view(f.rows, f.k))

    def encode(self, x: torch.Tensor, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After `select`: the joined tensors' bytes into `message` (the payloads, end to end);
        returns (positions [K] in the layout, the values every receiver decodes [K])."""
        if not self.tensors:
            return self.positions, x.new_empty(0)
        values = x.take(self.positions)                                           # [K] the kept values
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
        return self.positions, levels.view(-1).take(q.add_(self.segment.level_of))

    def read(self, messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Every rank's message [W, nbytes] -> (positions [W, K] in the layout, values [W, K],
        0-dim bool flags of malformed bytes: indices past a chunk (clamped), non-finite values)."""
        world = messages.shape[0]
        if not self.tensors:
            return self.positions.expand(world, 0), messages.new_empty(world, 0, dtype=torch.float32), []
        got, flags = self.map.read(messages), []
        T = len(self.tensors)
        levels = got[: world * T * LEVEL_BYTES].view(torch.float32).view(world, T * LEVELS)    # [W, 4T]
        positions = torch.empty(world, self.kept, dtype=torch.int64, device=messages.device)
        s = 0
        for f in self.families:
            parts = []
            for m, _, _ in f.coding.streams:
                parts.append(self._unpack(got, s, world).reshape(world * f.rows, m))   # [W·G, m]
                s += 1
            idx, bad = f.coding.join_flagged(parts, world * f.rows)
            flags += [bad] if bad is not None else []
            # [W·G, k] -> [W, G, k]: each rank's chunks against the family's chunk origins
            f.positions(idx.view(world, f.rows, f.k), positions[:, f.kept].view(world, f.rows, f.k))
        codes = self._unpack(got, s, world).add_(self.segment.level_of)                   # [W, K]: 4 · tensor + q
        values = levels.gather(1, codes)
        flags.append(checks.nonfinite(values))
        return positions, values, flags

    def _unpack(self, got: torch.Tensor, s: int, world: int) -> torch.Tensor:
        stream, at = self.map.streams[s], self.map.stream_at[s] * world
        return stream.unpack(got[at: at + world * stream.nbytes], world)
