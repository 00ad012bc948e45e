"""Bands of coefficient images end to end in one flat buffer (a `ChunkGroup`'s image, or one
tensor's), and top-k's steps over all of it; the transforms take the bands' `layout`
(`ChunkTransform.forward_bands` / `inverse_bands`).

Tensors of one chunk shape h × w can have different column counts C. Those of one C stack on
their rows into a band [R_j, C_j] (`ChunkGroup`: image i at rows [r_i, r_i + R_i) of its
band), and the bands lie end to end in one flat buffer. Every step that does not depend on
C runs once over the whole buffer:

    X P_wᵀ, C P_w           one GEMM over the buffer viewed [N / w, w] (each row: w elements of
                            one chunk row, in every band alike)
    P_h (·), P_hᵀ (·)       one batched GEMM per band: [h, h] @ [h, C_j] for each row block
    |·| chunk-major         one strided pass per band into a [chunks, h·w] scratch, the bands'
                            chunks one after the other
    top-k, positions, take  once: a chunk-local index j of chunk c is the flat position
                            origin_c + (j // w)·C_{band(c)} + j % w, from two tables

so a group costs a number of launches that grows with its bands (at most the distinct C of
its tensors: 3 for GPT-2's matrices), not with its tensors. One tensor is one band
(`ChunkedTopK` selects through a `Bands` of it), so a group's arithmetic is the per-tensor
path's, band by band: the same products per element, the right GEMM over more rows per call
(on CPU, MKL computes a row alike in calls of 12 rows or more), the same chunk rows to the
same top-k.
"""

from __future__ import annotations

import torch

from ..ops.select import largest_indices
from .chunking import ChunkPlan


class Bands:
    """Bands of `(rows, cols)` (each a stack of images of chunks h × w) end to end."""

    def __init__(self, bands: list[tuple[int, int]], h: int, w: int, device):
        self.h, self.w = h, w
        self.plans = [ChunkPlan((r, c), r, c, h, w, r, c) for r, c in bands]
        self.starts = [sum(p.padded_numel for p in self.plans[:j]) for j in range(len(self.plans))]
        # (start, rows, cols) of each band: what `ChunkTransform.forward_bands` / `inverse_bands` take
        self.layout = [(start, p.padded_rows, p.padded_cols) for start, p in zip(self.starts, self.plans)]
        self.numel = sum(p.padded_numel for p in self.plans)
        self.num_chunks = sum(p.num_chunks for p in self.plans)
        self._origins, self._offsets, self._shift = self._tables(device)

    def _tables(self, device):
        """origins [chunks, 1]: each chunk's (0, 0) in the buffer; offsets [bands · h·w]: index
        j's place from its chunk's origin in band b at b·h·w + j; shift [chunks, 1]: b·h·w
        (None with one band)."""
        h, w, origins, offsets, shift = self.h, self.w, [], [], []
        j = torch.arange(h * w)
        for b, (plan, start) in enumerate(zip(self.plans, self.starts)):
            (gr, gc), cols = plan.grid, plan.padded_cols
            # a*h*C + b*w for chunk (a, b), row-major over the band's chunk grid
            origins.append(start + (torch.arange(gr)[:, None] * (h * cols) + torch.arange(gc)[None, :] * w).view(-1))
            offsets.append(torch.div(j, w, rounding_mode="floor") * cols + j % w)
            shift.append(torch.full((plan.num_chunks,), b * h * w))
        shift = torch.cat(shift).view(-1, 1).to(device) if len(self.plans) > 1 else None
        return torch.cat(origins).view(-1, 1).to(device), torch.cat(offsets).to(device), shift

    def of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each band's [R_j, C_j] in a flat buffer of at least `numel` elements."""
        return [plan.matrix_in(flat[start:]) for plan, start in zip(self.plans, self.starts)]

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """Chunk-local indices [..., chunks, k] -> flat positions in the buffer, int64."""
        at = idx if self._shift is None else idx + self._shift
        return torch.take(self._offsets, at).add_(self._origins)

    def largest(self, image: torch.Tensor, k: int, scratch: torch.Tensor) -> torch.Tensor:
        """Chunk-local indices [chunks, k] of the k largest-magnitude coefficients of every chunk
        of the flat `image`, |·| written chunk-major into `scratch` (flat, >= numel) on the way."""
        h, w = self.h, self.w
        for plan, band, magnitude in zip(self.plans, self.of(image), self.of(scratch)):
            (gr, gc) = plan.grid
            # [R, C] -> [gr, h, gc, w] -> [gr, gc, h, w]: |coefficients| chunk-major, one strided pass
            torch.abs(band.view(gr, h, gc, w).permute(0, 2, 1, 3), out=magnitude.view(gr, gc, h, w))
        return largest_indices(scratch[: self.numel].view(self.num_chunks, h * w), k)

    def select(self, image: torch.Tensor, k: int, scratch: torch.Tensor):
        """`largest`, then (indices [chunks, k], their positions [chunks, k], their values [chunks, k])."""
        idx = self.largest(image, k, scratch)
        positions = self.positions(idx)
        return idx, positions, torch.take(image, positions)         # image[positions], 5x faster on CPU
