"""Random orthogonal bases that every rank can regenerate from a shared seed."""

from __future__ import annotations

import torch


def random_orthogonal(n: int, seed: int, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """A Haar-distributed n x n orthogonal matrix drawn from `seed`.

    Drawn on the CPU in float64 (QR of a Gaussian, columns sign-corrected by diag(R)) so
    that every rank, whatever its device, derives bit-identical bases without sending them.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    gaussian = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return q.to(dtype=dtype, device=device)
