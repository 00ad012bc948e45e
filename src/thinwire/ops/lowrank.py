"""Rank-r projections of a p x q matrix, GaLore's side rule, SVD refresh, moment rotation.

Side rule (GaLore): p >= q projects on the right, Q is q x r and the low-rank image of G
is g = G Q (p x r); p < q projects on the left, Q is p x r and g = Q^T G (r x q). Either
way the moments built from g have r (p + q) elements or fewer, never p q.
"""

from __future__ import annotations

import torch

RIGHT, LEFT = "right", "left"


def side(shape: tuple[int, int]) -> str:
    """'right' when p >= q, else 'left' (the side whose Q is the smaller matrix)."""
    return RIGHT if shape[0] >= shape[1] else LEFT


def basis_size(shape: tuple[int, int]) -> int:
    """Rows of Q: q on the right side, p on the left."""
    return shape[1] if side(shape) == RIGHT else shape[0]


def low_rank_shape(shape: tuple[int, int], rank: int) -> tuple[int, int]:
    """Shape of g (and of the moments): p x r on the right side, r x q on the left."""
    return (shape[0], rank) if side(shape) == RIGHT else (rank, shape[1])


def initial_basis(shape: tuple[int, int], rank: int, device=None) -> torch.Tensor:
    """The first r columns of the identity: every rank holds it without communicating,
    and with r = min(p, q) it makes the projection exact (g is G itself)."""
    return torch.eye(basis_size(shape), rank, device=device)


def project(x: torch.Tensor, q: torch.Tensor, where: str) -> torch.Tensor:
    """Low-rank image of the p x q matrix x: x Q (right) or Q^T x (left)."""
    return x @ q if where == RIGHT else q.T @ x


def lift(g: torch.Tensor, q: torch.Tensor, where: str) -> torch.Tensor:
    """Back to p x q: g Q^T (right) or Q g (left)."""
    return g @ q.T if where == RIGHT else q @ g


def top_singular_basis(delta: torch.Tensor, rank: int, where: str) -> torch.Tensor:
    """Top-r singular vectors of `delta` (fp32 SVD) on the projection side, as Q.

    Right: the leading right singular vectors (columns of V), q x r. Left: the leading
    left singular vectors, p x r. Singular vectors are unique only up to sign (and within
    repeated singular values); that freedom is harmless because the moments are rotated
    by Q_old^T Q_new, which absorbs it.
    """
    u, _, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    return (vh[:rank].T if where == RIGHT else u[:, :rank]).contiguous()


def rotate_moments(u: torch.Tensor, v: torch.Tensor, q_old: torch.Tensor, q_new: torch.Tensor,
                   where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments expressed in Q_old, re-expressed in Q_new (C = Q_old^T Q_new, r x r).

    First moment, a linear quantity: right u <- u C, left u <- C^T u, i.e. the projection
    of its lift u Q_old^T (or Q_old u) onto the new basis; exact when the bases span the
    same space. Second moment, a per-coordinate variance: treating the old coordinates as
    uncorrelated, Var((xC)_j) = sum_i C_ij^2 Var(x_i), so v <- v (C o C) (right) or
    (C o C)^T v (left). This keeps v >= 0, is exact for permutations and sign flips, and
    is what the authors' description ("rotate the moments") leaves open; it is our choice.
    """
    c = q_old.T @ q_new
    c2 = c * c
    if where == RIGHT:
        return u @ c, v @ c2
    return c.T @ u, c2.T @ v
