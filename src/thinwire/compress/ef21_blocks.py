"""An EF21 link's compressor over many tensors at once, in the per-tensor wire format.

EF21-Muon's messages hold one compressed payload per parameter, laid end to end
(`thinwire.optim.ef21_muon`). `BlockLink` writes and reads all of them with a number of
operations that does not grow with the number of tensors: the tensors of one size d form a
block [R, d] (`thinwire.compress.ef21_rows`), and each block is selected, packed and decoded
as a whole. The bytes are the per-tensor compressor's (`TopK`, `RandK`, `Identity`), at the
same places, so either side may be read by the other:

    encode   Top-K: one |x| over the flat buffer, then per block one top-k (its rows
             gathered by one `cat`) and one packing of its indices; Rand-K: per block one
             draw of uniform keys [R, d] and one top-k of them (a uniformly random K-subset
             per row); then one `take` of every kept value, one value-stage encode (per
             block for 'natural'), and one `index_select` that puts every byte in its place
    land     one `index_select` of every rank's bytes into the blocks' layout, one unpack
             per block, the values decoded, and Σ_r R_r in rank order: rank 0's values put,
             the others' added (`index_add_`), each rank's positions being distinct
    whole    Identity with a float stage: the flat buffer is encoded (decoded) at once

What arrived is checked on the device only (a 0-dim bool, True: malformed): packed indices
past their tensor, a bitmap not marking K positions, non-finite values.

Randomness: every draw is made on the tensors' device from `device_generator(seed)` (no
host draw, no copy): Rand-K's positions from the link's index seed, block after block, and
'natural' rounding from its value seed. These are not the per-tensor compressor's streams
(one seed per tensor): the same distributions (a uniform K-subset; unbiased rounding), other
draws. The sum over ranks equals the per-tensor path's dense sum but for the sign of a zero.

Memory, kept with the link: two int32 (int64 past 2^31) byte maps the size of the payload and
of the blocks' layout, and an int64 per kept value (two for packed Top-K indices): for Top-K
5 % with fp32 values about 3.4 bytes a parameter (0.85x the fp32 state of one kind), for
'natural' alone (every value kept) about 17. The whole form needs none.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.select import largest_indices
from ..wire import checks, index_width
from ..wire.spans import spans
from .ef21 import Identity, numel
from .ef21_rows import FLOAT_STAGES, ROW_STAGES, RowIndices, RowValues, device_generator
from .sparse import RandK, TopK


def groupable(comp) -> bool:
    """Whether `comp` has a block form: Identity, TopK or RandK with a row value stage."""
    return type(comp) in (Identity, TopK, RandK) and comp.values.name in ROW_STAGES


class Block(NamedTuple):
    """The tensors of one size d: their members (indices into the link's members), K kept
    per row, the index coding (None: no index bytes) and value stage, and where their bytes
    sit in the blocks' layout (`at`: their index rows, their values' span)."""
    members: list[int]
    d: int
    k: int
    indices: RowIndices | None
    values: RowValues
    at: list[int]
    kept: slice                    # their kept values among all the link's, block after block


def _blocks(comp, shapes) -> list[tuple[int, list[int]]]:
    by_size: dict[int, list[int]] = {}
    for i, s in enumerate(shapes):
        by_size.setdefault(numel(s), []).append(i)
    return list(by_size.items())


class BlockLink:
    """One link (uplink or downlink) over members of `shapes` whose payloads start at byte
    `offsets` of the message's payload (each `comp.payload_nbytes(shape)` long) and whose
    elements lie end to end in a flat buffer (module docstring)."""

    def __init__(self, comp, shapes, offsets, device):
        if not groupable(comp):
            raise ValueError(f"{comp!r} has no block form")
        self.comp, self.device = comp, torch.device(device)
        placed = spans(numel(s) for s in shapes)
        self.starts = [p.start for p in placed]
        self.numel = placed[-1].stop if placed else 0
        self.kind = "identity" if isinstance(comp, Identity) else comp.kind
        self.whole = self.kind == "identity" and comp.values.name in FLOAT_STAGES
        self.blocks: list[Block] = []
        self.nbytes = 0                                   # the blocks' layout, per rank
        if self.whole:
            self._whole_maps(shapes, offsets)
        else:
            self._layout(shapes)
            self._maps(offsets)
        self._landing: dict[int, torch.Tensor] = {}
        self.staging = torch.empty(max(self.nbytes, 1), dtype=torch.uint8, device=self.device)
        self._sent: torch.Tensor | None = None           # the last encode's kept positions (bytes: staging)

    # ---- layout ----------------------------------------------------------------------------
    def _layout(self, shapes) -> None:
        kept = 0
        specs = []
        for d, members in _blocks(self.comp, shapes):
            k = d if self.kind == "identity" else self.comp.k(shapes[members[0]])
            coding = None
            if self.kind == "topk":
                coding = RowIndices("bitmap" if self.comp.bitmap(shapes[members[0]]) else "packed", d, k, index_width(d))
            specs.append((members, d, k, coding, RowValues(self.comp.values, k), slice(kept, kept + len(members) * k)))
            kept += len(members) * k
        self.kept = kept
        at = 0
        index_at = []
        for members, _, _, coding, _, _ in specs:                      # every block's index rows first
            index_at.append(at)
            at += len(members) * (coding.row_nbytes if coding else 0)
        at = -(-at // 8) * 8                                            # value rows aligned for float views
        self.values_at = at
        for (members, d, k, coding, values, kept_slice), first in zip(specs, index_at):
            at = -(-at // values.align) * values.align
            self.blocks.append(Block(members, d, k, coding, values, [first, at], kept_slice))
            at += len(members) * values.nbytes
        self.nbytes = -(-at // 8) * 8
        self._positions()

    def _positions(self) -> None:
        """Per kept value, in the flat buffer: for Identity its position (`fixed`), else its
        row's first element (`base`) and, for packed Top-K indices, its row's last (`last`)."""
        base = torch.empty(self.kept, dtype=torch.int64)
        last = torch.empty(self.kept, dtype=torch.int64)
        for b in self.blocks:
            starts = torch.tensor([self.starts[i] for i in b.members], dtype=torch.int64)
            base[b.kept] = starts.repeat_interleave(b.k)
            last[b.kept] = b.d - 1
            if self.kind == "identity":
                base[b.kept] += torch.arange(b.d).repeat(len(b.members))
        self.base = base.to(self.device)
        packed = self.kind == "topk" and any(b.indices.coding == "packed" for b in self.blocks)
        self.last = last.to(self.device) if packed else None

    def _row_pieces(self, b: Block, j: int) -> list[tuple[int, int]]:
        """(place in the blocks' layout, length) of member row j's pieces, in wire order."""
        pieces = [] if b.indices is None else [(b.at[0] + j * b.indices.row_nbytes, b.indices.nbytes)]
        at, rows = b.at[1], len(b.members)
        for part in b.values.parts:                                     # each part's rows, part after part
            pieces.append((at + j * part, part))
            at += rows * part
        return pieces

    def _maps(self, offsets) -> None:
        """`send`: for each payload byte of the members, its place in the blocks' layout;
        `recv`: for each byte of the layout, the payload byte it comes from (padding: any)."""
        dst, src = [], []
        for b in self.blocks:
            for j, i in enumerate(b.members):
                at = offsets[i]
                for place, length in self._row_pieces(b, j):
                    dst.append(torch.arange(at, at + length))
                    src.append(torch.arange(place, place + length))
                    at += length
        self._set_maps(torch.cat(dst), torch.cat(src), self.nbytes)

    def _whole_maps(self, shapes, offsets) -> None:
        size = self.comp.values.nbytes(1)
        dst = torch.cat([torch.arange(o, o + numel(s) * size) for s, o in zip(shapes, offsets)])
        self.nbytes = self.numel * size
        self._set_maps(dst, torch.arange(self.nbytes), self.nbytes)

    def _set_maps(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        order = dst.argsort()
        dst, src = dst[order], src[order]
        self.lo, self.hi = (int(dst[0]), int(dst[-1]) + 1) if dst.numel() else (0, 0)
        wide = torch.int64 if max(self.hi, nbytes) >= 2 ** 31 else torch.int32
        self.span = dst.numel() == self.hi - self.lo                     # the members' bytes are one run
        recv = torch.zeros(nbytes, dtype=torch.int64)
        recv[src] = dst
        self.direct = self.span and torch.equal(src, torch.arange(nbytes))   # layout == payload bytes
        self.dst = None if self.span else dst.to(self.device)           # else the payload's bytes are [lo, hi)
        self.src = src.to(self.device, wide)
        self.recv = recv.to(self.device, wide)

    # ---- encode ----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, payload: torch.Tensor, index_seed: int, value_seed: int) -> None:
        """C(x) of every member (x: the flat buffer) into `payload`."""
        self._sent = None
        if self.whole and self.direct:
            self.comp.values.encode(x, payload[self.lo:self.hi])
            return
        stage = self.staging[:self.nbytes]
        if self.whole:
            self.comp.values.encode(x, stage)
        else:
            self._encode_blocks(x, stage, index_seed, value_seed)
        if self.span:
            torch.index_select(stage, 0, self.src, out=payload[self.lo:self.hi])
        else:
            payload.index_copy_(0, self.dst, stage.index_select(0, self.src))

    def _rows(self, flat: torch.Tensor, b: Block) -> torch.Tensor:
        """The block's members of `flat` as [R, d] (one `cat`, or a view for one member)."""
        views = [flat[self.starts[i]: self.starts[i] + b.d] for i in b.members]
        return views[0].view(1, -1) if len(views) == 1 else torch.cat(views).view(len(views), b.d)

    def _encode_blocks(self, x: torch.Tensor, stage: torch.Tensor, index_seed: int, value_seed: int) -> None:
        """Each block's positions (packed into `stage` for Top-K), then every kept value."""
        if self.kind == "identity":
            positions = self.base
        else:
            magnitude = x.abs() if self.kind == "topk" else None
            gen = device_generator(index_seed, x.device) if self.kind == "randk" else None
            chosen = []
            for b in self.blocks:
                if self.kind == "topk":
                    idx = largest_indices(self._rows(magnitude, b), b.k)
                    if b.indices.ascending():
                        idx = idx.sort(dim=1).values
                    b.indices.pack(idx, stage[b.at[0]: b.at[0] + len(b.members) * b.indices.row_nbytes])
                else:
                    idx = self._draw(b, gen, x.device)
                chosen.append(idx.reshape(-1))
            positions = torch.cat(chosen).add_(self.base) if len(chosen) > 1 else chosen[0] + self.base
        self._encode_values(x.take(positions), stage, value_seed)
        self._sent = positions

    def sent(self, out: torch.Tensor) -> bool:
        """out ← C(x) of the last `encode` as its receivers decode it, from the bytes it left in
        `staging` and the positions it chose (no unpacking); False when there is none (the
        whole form, or `forget`): decode the payload instead."""
        if self._sent is None:
            return False
        values = self._values(self.staging[None, :self.nbytes])
        out.zero_().index_put_((self._sent,), values[0])
        return True

    def forget(self) -> None:
        """The last encode's record is not this payload's (a step resumed from a checkpoint)."""
        self._sent = None

    def _draw(self, b: Block, gen: torch.Generator, device) -> torch.Tensor:
        """Rand-K: each row's K positions, a uniformly random K-subset (the K largest of d
        uniform keys), drawn from `gen` on `device`."""
        keys = torch.rand(len(b.members), b.d, generator=gen, device=device)
        return keys.topk(b.k, dim=1, sorted=False).indices

    def _encode_values(self, values: torch.Tensor, stage: torch.Tensor, value_seed: int) -> None:
        first = self.blocks[0].values
        if first.is_float:                                  # every block's values in one region
            first.encode(values.view(1, -1), stage[self.values_at: self.values_at + self.kept * first.nbytes // first.k],
                         None)
            return
        gen = device_generator(value_seed, values.device)
        for b in self.blocks:
            rows = len(b.members)
            span = stage[b.at[1]: b.at[1] + rows * b.values.nbytes]
            b.values.encode(values[b.kept].view(rows, b.k), span, gen)

    # ---- land ------------------------------------------------------------------------------
    def land(self, rows: torch.Tensor, index_seeds: list[int], out: torch.Tensor) -> torch.Tensor:
        """out ← Σ_r R_r, rank order, R_r decoded from rows[r] (the payloads, [W, payload
        bytes]; `index_seeds[r]`: rank r's index seed); returns the malformed flag (device)."""
        world = rows.shape[0]
        if self.whole:
            got = self._whole_values(rows)
            flags = [checks.nonfinite(got)]
            out.copy_(got[0])
            for r in range(1, world):
                out.add_(got[r])
            return checks.any_of(flags)
        landing = self._landing_buffer(world)
        torch.index_select(rows, 1, self.recv, out=landing)
        positions, values, flags = self._read_blocks(landing, index_seeds)
        out.zero_().index_put_((positions[0],), values[0])
        for r in range(1, world):
            out.index_add_(0, positions[r], values[r])
        return checks.any_of(flags)

    def _whole_values(self, rows: torch.Tensor) -> torch.Tensor:
        """Identity with a float stage: every rank's values, [W, numel] float32."""
        landing = self._landing_buffer(rows.shape[0])
        if self.direct:
            landing.copy_(rows[:, self.lo:self.hi])
        else:
            torch.index_select(rows, 1, self.recv, out=landing)
        codec = self.comp.values.codec
        return landing.view(codec.dtype).float()

    def _landing_buffer(self, world: int) -> torch.Tensor:
        buf = self._landing.get(world)
        if buf is None:
            buf = self._landing[world] = torch.empty(world, self.nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def _read_blocks(self, landing: torch.Tensor, index_seeds: list[int]):
        """Every rank's positions (in the flat buffer) and values, [W, kept], and the flags."""
        world, values = landing.shape[0], self._values(landing)
        flags = [checks.nonfinite(values)]
        if self.kind == "identity":
            return self.base.expand(world, -1), values, flags
        rel = torch.empty(world, self.kept, dtype=torch.int64, device=landing.device)
        gens = [device_generator(seed, landing.device) for seed in index_seeds] if self.kind == "randk" else []
        for b in self.blocks:
            rows = len(b.members)
            if self.kind == "topk":
                area = landing[:, b.at[0]: b.at[0] + rows * b.indices.row_nbytes]
                idx, bad = b.indices.unpack(area.contiguous(), world * rows)
                rel[:, b.kept].view(world, rows, b.k).copy_(idx.view(world, rows, b.k))
                if bad is not None:
                    flags.append(bad)
            else:                                                   # Rand-K: each sender's draws again
                for r, gen in enumerate(gens):
                    rel[r, b.kept].view(rows, b.k).copy_(self._draw(b, gen, landing.device))
        if self.last is not None:
            flags.append(rel.gt(self.last).any())
            torch.minimum(rel, self.last, out=rel)            # a malformed index lands in its own tensor
        return rel.add_(self.base), values, flags

    def _values(self, landing: torch.Tensor) -> torch.Tensor:
        world, first = landing.shape[0], self.blocks[0].values
        if first.is_float:
            size = first.nbytes // first.k
            region = landing[:, self.values_at: self.values_at + self.kept * size]
            return region.view(first.stage.codec.dtype).float()
        pieces = []
        for b in self.blocks:
            span = landing[:, b.at[1]: b.at[1] + len(b.members) * b.values.nbytes]
            pieces.append(b.values.decode(span, len(b.members)).view(world, -1))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
