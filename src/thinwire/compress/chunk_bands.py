"""The image of a `ChunkGroup`: bands of stacked coefficient images, one flat buffer, and the
chunked transform's and top-k's steps over all of it.

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
its tensors: 3 for GPT-2's matrices), not with its tensors. The arithmetic is
`ChunkTransform.forward_image` / `inverse_image` and `ChunkedTopK.select_in`, band by band:
the same products per element, the right GEMM over more rows per call (on CPU, MKL computes
a row alike in calls of 12 rows or more), the same chunk rows to the same top-k.
"""

from __future__ import annotations

import torch

from ..ops.select import largest_indices
from .chunking import ChunkPlan
from .transforms import ChunkTransform


class Bands:
    """Bands of `(rows, cols)` (each a stack of images of chunks h × w) end to end."""

    def __init__(self, bands: list[tuple[int, int]], h: int, w: int, device):
        self.h, self.w = h, w
        self.plans = [ChunkPlan((r, c), r, c, h, w, r, c) for r, c in bands]
        self.starts = [sum(p.padded_numel for p in self.plans[:j]) for j in range(len(self.plans))]
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

    def forward(self, transform: ChunkTransform, x: torch.Tensor, out: torch.Tensor, step: int,
                scratch: torch.Tensor, beta: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
        """out ← β·out + α·T(x) (`ChunkTransform.forward_image`, band by band): x, out flat
        [numel]; scratch flat, >= numel."""
        ph, pw = transform.basis(self.h, step, x.device), transform.basis(self.w, step, x.device)
        t = x
        if pw is not None:                                          # X P_wᵀ: [N / w, w] @ [w, w]
            t = torch.mm(x.view(-1, self.w), pw.T, out=scratch[: self.numel].view(-1, self.w)).view(-1)
        if ph is None:
            return torch.mul(t, alpha, out=out) if beta == 0.0 else out.mul_(beta).add_(t, alpha=alpha)
        for plan, o, s in zip(self.plans, self.of(out), self.of(t)):
            gr, cols = plan.grid[0], plan.padded_cols
            # o[a] ← β o[a] + α P_h s[a]: [h, h] @ [h, C_j] for each of the band's row blocks
            o.view(gr, self.h, cols).baddbmm_(ph.expand(gr, self.h, self.h), s.view(gr, self.h, cols),
                                              beta=beta, alpha=alpha)
        return out

    def inverse(self, transform: ChunkTransform, coeffs: torch.Tensor, step: int,
                scratch: torch.Tensor) -> torch.Tensor:
        """In place: coeffs (flat [numel]) ← T⁻¹(coeffs) (`ChunkTransform.inverse_image`)."""
        ph, pw = transform.basis(self.h, step, coeffs.device), transform.basis(self.w, step, coeffs.device)
        if ph is None and pw is None:
            return coeffs
        t = scratch[: self.numel]
        if pw is not None:                                          # C P_w: [N / w, w] @ [w, w]
            torch.mm(coeffs.view(-1, self.w), pw, out=t.view(-1, self.w))
        else:
            t.copy_(coeffs)
        if ph is None:
            return coeffs.copy_(t)
        for plan, c, s in zip(self.plans, self.of(coeffs), self.of(t)):
            gr, cols = plan.grid[0], plan.padded_cols
            # P_hᵀ (C P_w)[a] for each row block a: [h, h] @ [h, C_j]
            torch.bmm(ph.T.expand(gr, self.h, self.h), s.view(gr, self.h, cols), out=c.view(gr, self.h, cols))
        return coeffs

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """Chunk-local indices [..., chunks, k] -> flat positions in the buffer, int64."""
        at = idx if self._shift is None else idx + self._shift
        return torch.take(self._offsets, at).add_(self._origins)

    def select(self, image: torch.Tensor, k: int, scratch: torch.Tensor):
        """The k largest-magnitude coefficients of every chunk of the flat `image`: (chunk-local
        indices [chunks, k], their positions [chunks, k], their values [chunks, k])."""
        h, w = self.h, self.w
        for plan, band, magnitude in zip(self.plans, self.of(image), self.of(scratch)):
            (gr, gc) = plan.grid
            # [R, C] -> [gr, h, gc, w] -> [gr, gc, h, w]: |coefficients| chunk-major, one strided pass
            torch.abs(band.view(gr, h, gc, w).permute(0, 2, 1, 3), out=magnitude.view(gr, gc, h, w))
        idx = largest_indices(scratch[: self.numel].view(self.num_chunks, h * w), k)
        positions = self.positions(idx)
        return idx, positions, torch.take(image, positions)         # image[positions], 5x faster on CPU
