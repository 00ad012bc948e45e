"""Separable orthogonal transforms applied to every chunk: C = P_h X P_w^T, X = P_h^T C P_w.

The transforms work on the whole padded matrix in its natural layout, as two large matrix
products (one over the column blocks, one batched over the row blocks) instead of one tiny
product per chunk; only the coefficients for top-k are reordered chunk-major.
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

    def forward(self, m: torch.Tensor, plan: ChunkPlan, step: int = 0) -> torch.Tensor:
        """Padded matrix [R, C] -> coefficients chunk-major [num_chunks, h*w] (float32)."""
        (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
        ph, pw = self.basis(h, step, m.device), self.basis(w, step, m.device)
        m = m.float()
        if pw is not None:
            m = torch.matmul(m.reshape(-1, w), pw.T)                     # [R*gc, w] @ [w, w]
        if ph is not None:
            m = torch.matmul(ph, m.reshape(gr, h, gc * w))                # [h, h] @ [gr, h, C]
        # [gr, h, gc, w] -> [gr, gc, h, w] -> [n, h*w]
        return m.reshape(gr, h, gc, w).permute(0, 2, 1, 3).reshape(plan.num_chunks, h * w)

    def inverse(self, coeffs: torch.Tensor, plan: ChunkPlan, step: int = 0) -> torch.Tensor:
        """Coefficients chunk-major [num_chunks, h*w] -> padded matrix [R, C] (float32)."""
        (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
        ph, pw = self.basis(h, step, coeffs.device), self.basis(w, step, coeffs.device)
        x = coeffs
        if pw is not None:
            x = torch.matmul(x.reshape(-1, w), pw)                        # [n*h, w] @ [w, w]
        # [gr, gc, h, w] -> [gr, h, gc, w]
        x = x.reshape(gr, gc, h, w).permute(0, 2, 1, 3).reshape(gr, h, gc * w)
        if ph is not None:
            x = torch.matmul(ph.T, x)                                     # [h, h] @ [gr, h, C]
        return x.reshape(plan.padded_rows, plan.padded_cols)

    def sparse_inverse(self, idx: torch.Tensor, vals: torch.Tensor, plan: ChunkPlan, step: int = 0) -> torch.Tensor:
        """Values [gr, gc, h, w] of chunks holding only the coefficients vals at idx ([n, k]).

        X = sum_j c_j outer(P_h[u_j], P_w[v_j]) = A^T B with A = c * P_h[u], B = P_w[v]:
        about h*w*k multiply-adds per chunk instead of the dense h*w*(h+w).
        """
        (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
        ph = self.basis(h, step, vals.device)
        pw = self.basis(w, step, vals.device)
        ph = torch.eye(h, device=vals.device) if ph is None else ph
        pw = torch.eye(w, device=vals.device) if pw is None else pw
        n, k = idx.shape
        rows = torch.div(idx, w, rounding_mode="floor")                    # coefficient (u, v) = divmod(idx, w)
        cols = idx - rows * w
        a = ph.index_select(0, rows.view(-1)).view(n, k, h).mul_(vals[..., None])   # [n, k, h]
        b = pw.index_select(0, cols.view(-1)).view(n, k, w)                         # [n, k, w]
        return torch.bmm(a.transpose(1, 2), b).view(gr, gc, h, w)
