"""Muon's orthogonalisation: a quintic Newton-Schulz iteration towards U V^T of G = U S V^T."""

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
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T                                     # [r, r], r = min(rows, cols)
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Muon's 'original' learning-rate scale for a rows x cols matrix: sqrt(max(1, rows/cols))."""
    rows, cols = shape[0], shape[1]
    return math.sqrt(max(1.0, rows / cols))
