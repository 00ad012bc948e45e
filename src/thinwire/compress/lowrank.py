"""Rank-K compression: the best rank-K approximation of a tensor's matrix view.

The tensor is viewed as a matrix m x n (`matrix_shape`: conv weights (o, i, kh, kw) become
o x i*kh*kw, vectors 1 x d). With the truncated SVD  x ~ U_K S_K V_K^T  the wire carries
the factors L = U_K S_K (m x K) and R = V_K^T (K x n), concatenated and sent through the
value stage: (m + n) K values. Eckart-Young gives ||x - L R||^2 = sum_{i>K} s_i^2 <=
(1 - K / min(m, n)) ||x||^2, so alpha = K / min(m, n) with fp32 factors (up to rounding);
with lossy factors the error of a product has no clean bound and alpha is None.
When K >= min(m, n) or (m + n) K >= m n the matrix is sent whole instead (lossless in
fp32), which is never larger.

The SVD (torch.linalg.svd, float32) is deterministic for a given machine and thread
count; with topology='replicated' every rank computes the server's compression itself,
so use identical hardware there (topology='server' computes it once, on rank 0).
"""

from __future__ import annotations

import torch

from .chunking import matrix_shape
from .ef21 import EF21Compressor, check_count


class RankK(EF21Compressor):
    """Rank-K factors of the matrix view; see the module docstring."""

    kind = "rank"

    def __init__(self, rank: int, values: str = "fp32"):
        super().__init__(values)
        self.rank = check_count(rank, "rank K")

    @property
    def name(self) -> str:
        suffix = "" if self.values.name == "fp32" else f"+{self.values.name}"
        return f"rank:{self.rank}{suffix}"

    def _dense(self, shape) -> bool:
        m, n = matrix_shape(tuple(shape))
        return self.rank >= min(m, n) or (m + n) * self.rank >= m * n

    def _count(self, shape) -> int:
        m, n = matrix_shape(tuple(shape))
        return m * n if self._dense(shape) else (m + n) * self.rank

    def alpha(self, shape):
        m, n = matrix_shape(tuple(shape))
        if self._dense(shape):
            return self._value_alpha(1.0)
        return self.rank / min(m, n) if self.values.lossless else None

    def payload_nbytes(self, shape) -> int:
        return self.values.nbytes(self._count(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        if self._dense(x.shape):
            self.values.encode(x.reshape(-1), out, seed)
            return
        m, n = matrix_shape(tuple(x.shape))
        u, s, vh = torch.linalg.svd(x.reshape(m, n).float(), full_matrices=False)
        k = self.rank
        factors = torch.cat([(u[:, :k] * s[:k]).reshape(-1), vh[:k].reshape(-1)])
        self.values.encode(factors, out, seed)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        flat = self._finite(self.values.decode(self._buffer(buf, shape), self._count(shape)))
        if self._dense(shape):
            return flat.view(tuple(shape))
        m, n = matrix_shape(tuple(shape))
        k = self.rank
        return (flat[: m * k].view(m, k) @ flat[m * k:].view(k, n)).view(tuple(shape))
