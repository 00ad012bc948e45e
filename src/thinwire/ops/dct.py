"""Orthonormal DCT-II matrices, built once per size and reused."""

from __future__ import annotations

import math

import torch

_CACHE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The n x n orthonormal DCT-II matrix D, rows = basis functions, so `D @ x` is DCT(x).

        D[k, j] = sqrt(2/n) * c_k * cos(pi * (2j + 1) * k / (2n)),   c_0 = 1/sqrt(2), c_k = 1

    D is orthogonal (D @ D.T = I), so the inverse transform is `D.T @ X`. Built in float64
    and cast, so every rank and device gets the same rounding of the same exact values.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    key = (n, dtype, torch.device(device))
    if key not in _CACHE:
        k = torch.arange(n, dtype=torch.float64)[:, None]
        j = torch.arange(n, dtype=torch.float64)[None, :]
        d = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
        d[0] /= math.sqrt(2.0)
        _CACHE[key] = d.to(dtype=dtype, device=key[2])
    return _CACHE[key]
