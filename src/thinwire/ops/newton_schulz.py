"""Muon's orthogonalisation: a quintic Newton-Schulz iteration towards U V^T of G = U S V^T,
one matrix at a time (`orthogonalize`) or a batch of matrices of one shape at once
(`orthogonalize_batch`: `torch.bmm` / `torch.baddbmm`, as microsoft/dion batches it)."""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's (a, b, c): maximal slope at zero
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS, eps: float = NS_EPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> torch.Tensor:
    """Approximately orthogonalise a 2-D `g` (bf16 arithmetic, as Muon does); returns bf16.

    X = G / max(||G||_F, eps); wide orientation (tall matrices are transposed);
    repeat `steps` times:  A = X X^T;  B = b A + c A A;  X = a X + B X.
    """
    if g.dim() != 2:
        raise ValueError(f"orthogonalize needs a 2-D tensor, got shape {tuple(g.shape)}")
    return _orthogonalized(g, steps, eps, coefficients)


def orthogonalize_batch(g: torch.Tensor, steps: int = NS_STEPS, eps: float = NS_EPS,
                        coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> torch.Tensor:
    """`orthogonalize` of every matrix of g [B, rows, cols] at once, in 3 + 3 · steps launches
    (and a cast from float32) whatever B; returns bf16 [B, rows, cols] (a transposed view for
    tall matrices, as `orthogonalize` returns them). The same operations on the same layouts (a
    tall batch transposed as a view, as `orthogonalize` transposes one matrix): on CPU bit for
    bit `orthogonalize` of each matrix (tests/ops); a GPU's batched GEMM may pick another
    kernel than its single one, and so sum in another order (float rounding only)."""
    if g.dim() != 3:
        raise ValueError(f"orthogonalize_batch needs a [batch, rows, cols] tensor, got shape {tuple(g.shape)}")
    return _orthogonalized(g, steps, eps, coefficients)


def _orthogonalized(g: torch.Tensor, steps: int, eps: float, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """The iteration of `orthogonalize` on one matrix (`torch.mm`, `torch.addmm`) or a batch of
    them ([B, rows, cols]: `torch.bmm`, `torch.baddbmm`, the norm per matrix)."""
    a, b, c = coefficients
    batched = g.dim() == 3
    mm, addmm = (torch.bmm, torch.baddbmm) if batched else (torch.mm, torch.addmm)
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) if batched else x.norm()
    x = x / norm.clamp(min=eps)
    for _ in range(steps):
        gram = mm(x, x.mT)                                 # [.., r, r], r = min(rows, cols)
        update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, update, x, beta=a)
    return x.mT if tall else x


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Muon's 'original' learning-rate scale for a rows x cols matrix: sqrt(max(1, rows/cols))."""
    rows, cols = shape[0], shape[1]
    return math.sqrt(max(1.0, rows / cols))
