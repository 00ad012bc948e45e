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

import torch

from ..ops import dct_matrix, random_orthogonal
from .chunking import ChunkPlan

TRANSFORMS = ("dct", "random", "identity")


def _basis_seed(seed: int, step: int, n: int) -> int:
    # A hash, not seed + step: neighbouring (seed, step) pairs must not share bases.
    digest = hashlib.blake2b(f"{seed}:{step}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def _matrix(scratch: torch.Tensor | None, rows: int, cols: int, device) -> torch.Tensor:
    """A [rows, cols] float32 matrix: the front of `scratch` (flat), or a fresh tensor."""
    if scratch is None:
        return torch.empty(rows, cols, device=device)
    return scratch[: rows * cols].view(rows, cols)


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
        (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
        rows, cols = plan.padded_rows, plan.padded_cols
        ph, pw = self.basis(h, step, x.device), self.basis(w, step, x.device)
        if out is None:
            out, beta = torch.empty(rows, cols, device=x.device), 0.0
        t = _matrix(scratch, rows * gc, w, x.device)
        given = x.shape[0] * gc                                            # rows of t that x fills
        if pw is not None:
            torch.mm(x.view(given, w), pw.T, out=t[:given])                # X P_wᵀ: [R*gc, w] @ [w, w]
        else:
            t[:given].copy_(x.view(given, w))
        if given < rows * gc:                                              # x gave fewer rows
            t[given:].zero_()
        if ph is not None:
            # out[a] ← β out[a] + α P_h (X P_wᵀ)[a]: [h, h] @ [h, C] for each of the gr row blocks
            out.view(gr, h, cols).baddbmm_(ph.expand(gr, h, h), t.view(gr, h, cols), beta=beta, alpha=alpha)
        elif beta == 0.0:
            torch.mul(t.view(rows, cols), alpha, out=out)
        else:
            out.mul_(beta).add_(t.view(rows, cols), alpha=alpha)
        return out

    def inverse_image(self, coeffs: torch.Tensor, plan: ChunkPlan, step: int = 0, *,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
        """In place: an image-layout coefficient matrix [R, C] becomes the padded matrix
        T⁻¹(coeffs) = P_hᵀ C P_w per chunk; `scratch` (flat float32, >= R*C) holds the
        intermediate. Returns `coeffs`."""
        (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
        rows, cols = plan.padded_rows, plan.padded_cols
        ph, pw = self.basis(h, step, coeffs.device), self.basis(w, step, coeffs.device)
        if ph is None and pw is None:
            return coeffs
        t = _matrix(scratch, rows * gc, w, coeffs.device)
        if pw is not None:
            torch.mm(coeffs.view(rows * gc, w), pw, out=t)                # C P_w: [R*gc, w] @ [w, w]
        else:
            t.copy_(coeffs.view(rows * gc, w))
        if ph is not None:
            # P_hᵀ (C P_w)[a] for each row block a: [h, h] @ [h, C]
            torch.bmm(ph.T.expand(gr, h, h), t.view(gr, h, cols), out=coeffs.view(gr, h, cols))
        else:
            coeffs.view(rows * gc, w).copy_(t)
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
