"""Separable orthogonal transforms applied to every chunk: C = P_h X P_w^T, X = P_h^T C P_w.

Coefficients are kept in *image layout*: coefficient (u, v) of chunk (a, b) sits where the
chunk's element (u, v) sits in the padded matrix, at [a*h + u, b*w + v]. In that layout
both transforms are two large matrix products over the matrix as it lies (one GEMM over
all column blocks, one batched GEMM over the row blocks) with no reordering copy, and the
second product can fold in a decay and a scale (M ← βM + α T(X) in one BLAS call). Only
top-k needs the coefficients chunk-major, and it reads them through a strided view.

Intermediates go to a caller's `scratch` buffer when one is given: on CPU, the page
faults of a fresh 100 MB temporary cost about as much as a GEMM over it.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from ..ops import dct_matrix, random_orthogonal
from .chunking import ChunkPlan

TRANSFORMS = ("dct", "random", "identity")


def _basis_seed(seed: int, step: int, n: int) -> int:
    # A hash, not seed + step: neighbouring (seed, step) pairs must not share bases.
    digest = hashlib.blake2b(f"{seed}:{step}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


Band = tuple[int, int, int]      # (start, rows, cols): an image [rows, cols] at element `start` of a flat buffer


class ChunkTransform:
    """Orthonormal per-chunk basis change.

    'dct': the orthonormal DCT-II on both chunk axes (fixed basis).
    'random': a Haar-random orthogonal basis per chunk size, redrawn every step from
        (seed, step), identical on every rank, never sent.
    'identity': no change of basis (top-k then acts on raw values).
    """

    def __init__(self, kind: str = "dct", seed: int = 0):
        if kind not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {kind!r}")
        self.kind, self.seed = kind, int(seed)
        self._random_cache: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def basis(self, n: int, step: int, device) -> torch.Tensor | None:
        """P (n x n, rows = basis vectors), or None for the identity."""
        if self.kind == "identity" or n == 1:
            return None
        if self.kind == "dct":
            return dct_matrix(n, torch.float32, device)
        key = (n, step, torch.device(device))
        if key not in self._random_cache:
            # Only the current step's bases are kept: they change every step.
            self._random_cache = {k: v for k, v in self._random_cache.items() if k[1] == step}
            self._random_cache[key] = random_orthogonal(n, _basis_seed(self.seed, step, n), device=device)
        return self._random_cache[key]

    def forward_image(self, x: torch.Tensor, plan: ChunkPlan, step: int = 0, *, out: torch.Tensor | None = None,
                      scratch: torch.Tensor | None = None, beta: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
        """out ← β·out + α·T(x): x the padded float32 matrix [R, C] (or its first rows, when
        the plan pads only rows: the rest count as zeros), out its coefficients in image
        layout [R, C] (allocated when None; with β = 0 its old content is ignored). `out`
        may be x itself; `scratch` (flat float32, >= R*C) holds the intermediate."""
        if out is None:
            out, beta = torch.empty(plan.padded_rows, plan.padded_cols, device=x.device), 0.0
        self.forward_bands(x.reshape(-1), out.view(-1), plan.chunk_rows, plan.chunk_cols,
                           [(0, plan.padded_rows, plan.padded_cols)], step, scratch=scratch, beta=beta, alpha=alpha)
        return out

    def inverse_image(self, coeffs: torch.Tensor, plan: ChunkPlan, step: int = 0, *,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
        """In place: an image-layout coefficient matrix [R, C] becomes the padded matrix
        T⁻¹(coeffs) = P_hᵀ C P_w per chunk; `scratch` (flat float32, >= R*C) holds the
        intermediate. Returns `coeffs`."""
        self.inverse_bands(coeffs.view(-1), plan.chunk_rows, plan.chunk_cols,
                           [(0, plan.padded_rows, plan.padded_cols)], step, scratch=scratch)
        return coeffs

    def forward_bands(self, x: torch.Tensor, out: torch.Tensor, h: int, w: int, bands: Sequence[Band], step: int = 0,
                      *, scratch: torch.Tensor | None = None, beta: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
        """`forward_image` over images of chunks h × w end to end in one flat buffer: band
        (start, R, C) is the image [R, C] at elements [start, start + R·C) of `out` (flat). x:
        flat, the same layout, or only its first elements (the rest count as zeros); `out` may
        be x itself. The right product is one GEMM over every band (it does not see C), the
        left one batched GEMM per band."""
        ph, pw = self.basis(h, step, x.device), self.basis(w, step, x.device)
        n, given = sum(rows * cols for _, rows, cols in bands), x.numel()
        t = torch.empty(n, device=x.device) if scratch is None else scratch[:n]
        if pw is not None:                                                 # X P_wᵀ: [N / w, w] @ [w, w]
            torch.mm(x.view(-1, w), pw.T, out=t[:given].view(-1, w))
        elif given < n or x.data_ptr() == out.data_ptr():                  # t: x padded, apart from out
            t[:given].copy_(x)
        else:
            t = x
        if given < n:                                                      # x gave fewer rows
            t[given:].zero_()
        if ph is None:
            return torch.mul(t, alpha, out=out) if beta == 0.0 else out.mul_(beta).add_(t, alpha=alpha)
        for start, rows, cols in bands:
            gr, at = rows // h, slice(start, start + rows * cols)
            # out[a] ← β out[a] + α P_h (X P_wᵀ)[a]: [h, h] @ [h, C] for each of the band's row blocks
            out[at].view(gr, h, cols).baddbmm_(ph.expand(gr, h, h), t[at].view(gr, h, cols), beta=beta, alpha=alpha)
        return out

    def inverse_bands(self, coeffs: torch.Tensor, h: int, w: int, bands: Sequence[Band], step: int = 0, *,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
        """In place: `inverse_image` over the bands of a flat buffer (`forward_bands`): one GEMM
        for the right product, one batched GEMM per band for the left. Returns `coeffs`."""
        ph, pw = self.basis(h, step, coeffs.device), self.basis(w, step, coeffs.device)
        if ph is None and pw is None:
            return coeffs
        n = sum(rows * cols for _, rows, cols in bands)
        t = torch.empty(n, device=coeffs.device) if scratch is None else scratch[:n]
        if pw is not None:                                                 # C P_w: [N / w, w] @ [w, w]
            torch.mm(coeffs[:n].view(-1, w), pw, out=t.view(-1, w))
        else:
            t.copy_(coeffs[:n])
        if ph is None:
            return coeffs[:n].copy_(t)
        for start, rows, cols in bands:
            gr, at = rows // h, slice(start, start + rows * cols)
            # P_hᵀ (C P_w)[a] for each row block a: [h, h] @ [h, C]
            torch.bmm(ph.T.expand(gr, h, h), t[at].view(gr, h, cols), out=coeffs[at].view(gr, h, cols))
        return coeffs

    def zero_padding_(self, image: torch.Tensor, plan: ChunkPlan, step: int = 0) -> torch.Tensor:
        """In place: image ← T(P·T⁻¹(image)), P zeroing the plan's padding, so the image holds
        coefficients of a matrix that is zero where the tensor has no elements (as a
        transformed zero-padded tensor always is). Only the last block row and block column
        of chunks overlap the padding; only they are transformed. Returns `image`."""
        (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
        rows, cols = plan.padded_rows, plan.padded_cols
        if plan.padded_rows > plan.rows:              # last block row: [h, C], contiguous
            strip = ChunkPlan(plan.shape, h, cols, h, w, h, cols)
            block = image[rows - h:]
            self.inverse_image(block, strip, step)[plan.rows - (rows - h):].zero_()
            self.forward_image(block, strip, step, out=block)
        if plan.padded_cols > plan.cols:              # last block column: [R, w], strided
            strip = ChunkPlan(plan.shape, rows, w, h, w, rows, w)
            block = image[:, cols - w:].contiguous()
            self.inverse_image(block, strip, step)[:, plan.cols - (cols - w):].zero_()
            image[:, cols - w:] = self.forward_image(block, strip, step)
        return image
