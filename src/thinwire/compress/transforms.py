"""Separable orthogonal transforms applied to every chunk: C = P_h X P_w^T, X = P_h^T C P_w."""

from __future__ import annotations

import hashlib

import torch

from ..ops import dct_matrix, random_orthogonal

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

    def forward(self, chunks: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[..., h, w] values -> [..., h, w] coefficients."""
        ph = self.basis(chunks.shape[-2], step, chunks.device)
        pw = self.basis(chunks.shape[-1], step, chunks.device)
        out = chunks if ph is None else torch.matmul(ph, chunks)
        return out if pw is None else torch.matmul(out, pw.T)

    def inverse(self, coeffs: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[..., h, w] coefficients -> [..., h, w] values."""
        ph = self.basis(coeffs.shape[-2], step, coeffs.device)
        pw = self.basis(coeffs.shape[-1], step, coeffs.device)
        out = coeffs if ph is None else torch.matmul(ph.T, coeffs)
        return out if pw is None else torch.matmul(out, pw)
