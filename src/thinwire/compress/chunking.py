"""How a tensor of any shape is cut into equal 2-D chunks for a chunked transform.

A tensor is first viewed as a matrix:
    0-D ()            -> (1, 1)
    1-D (n,)          -> (1, n)
    2-D (r, c)        -> (r, c)
    k-D (d0, d1, ...) -> (d0, d1 * d2 * ...)   e.g. a conv weight (out, in, kh, kw) -> (out, in*kh*kw)
Each matrix dimension n gets a chunk size by `chunk_size(n, target)`; a dimension with no
divisor in [target/2, target] is zero-padded up to a multiple of `target`, never cut into
chunks of 1 (bloc97/DeMo takes the largest divisor <= target, which is 1 for a prime n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_size(n: int, target: int) -> tuple[int, int]:
    """(chunk, padded_n) for one dimension of size n.

    n <= target: one chunk of n. Otherwise the largest divisor d of n with d <= target if
    d >= target / 2 (no padding), else chunk `target` with n padded up to a multiple of it.
    """
    if n < 1 or target < 1:
        raise ValueError(f"n and target must be >= 1, got n={n}, target={target}")
    if n <= target:
        return n, n
    divisor = max(d for d in range(1, target + 1) if n % d == 0)
    if 2 * divisor >= target:
        return divisor, n
    return target, math.ceil(n / target) * target


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view of a tensor shape used for chunking (see module docstring)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk geometry of one tensor shape."""

    shape: tuple[int, ...]
    rows: int          # matrix view
    cols: int
    chunk_rows: int    # h
    chunk_cols: int    # w
    padded_rows: int
    padded_cols: int

    @classmethod
    def for_shape(cls, shape, target: int) -> "ChunkPlan":
        shape = tuple(int(s) for s in shape)
        if any(s == 0 for s in shape):
            raise ValueError(f"cannot chunk an empty tensor of shape {shape}")
        rows, cols = matrix_shape(shape)
        h, prows = chunk_size(rows, target)
        w, pcols = chunk_size(cols, target)
        return cls(shape, rows, cols, h, w, prows, pcols)

    @property
    def grid(self) -> tuple[int, int]:
        return self.padded_rows // self.chunk_rows, self.padded_cols // self.chunk_cols

    @property
    def num_chunks(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def chunk_elems(self) -> int:
        return self.chunk_rows * self.chunk_cols

    @property
    def padded(self) -> bool:
        return (self.padded_rows, self.padded_cols) != (self.rows, self.cols)

    @property
    def padded_numel(self) -> int:
        return self.padded_rows * self.padded_cols

    def matrix_in(self, buf: torch.Tensor) -> torch.Tensor:
        """The front of a flat buffer (>= padded_numel elements) viewed as [padded_rows, padded_cols]."""
        return buf[: self.padded_numel].view(self.padded_rows, self.padded_cols)

    def padded_matrix(self, x: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
        """[*shape] -> float32 [padded_rows, padded_cols]: a view of x when x is float32,
        contiguous and unpadded, else a copy, written into the front of `buf` (flat float32,
        >= padded_numel) when given, so no fresh full-size tensor is allocated."""
        m = x.reshape(self.rows, self.cols)
        if not self.padded and m.dtype == torch.float32 and m.is_contiguous():
            return m
        return self._padded_copy(m, buf)

    def transform_input(self, x: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
        """What `ChunkTransform.forward_image` takes: like `padded_matrix`, but a float32
        contiguous x whose plan pads only rows stays a view [rows, padded_cols] (the
        transform treats the missing rows as zeros), saving a copy of the whole tensor."""
        if self.cols == self.padded_cols and self.rows < self.padded_rows:
            m = x.reshape(self.rows, self.cols)
            if m.dtype == torch.float32 and m.is_contiguous():
                return m
        return self.padded_matrix(x, buf)

    def _padded_copy(self, m: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
        if buf is None:
            buf = torch.empty(self.padded_numel, dtype=torch.float32, device=m.device)
        out = self.matrix_in(buf)
        out[: self.rows, : self.cols].copy_(m)
        out[: self.rows, self.cols:].zero_()
        out[self.rows:].zero_()
        return out

    def crop(self, m: torch.Tensor) -> torch.Tensor:
        """[padded_rows, padded_cols] -> [*shape], dropping padding."""
        return m[: self.rows, : self.cols].reshape(self.shape)

    def chunk_view(self, m: torch.Tensor) -> torch.Tensor:
        """[padded_rows, padded_cols] -> [grid_r, grid_c, h, w] strided view of the same storage."""
        gr, gc = self.grid
        # [R, C] -> [gr, h, gc, w] -> [gr, gc, h, w]
        return m.view(gr, self.chunk_rows, gc, self.chunk_cols).permute(0, 2, 1, 3)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[*shape] -> [grid_r, grid_c, h, w] (zero padding where the plan pads)."""
        return self.chunk_view(self.padded_matrix(x))

    def from_chunks(self, chunks: torch.Tensor) -> torch.Tensor:
        """[grid_r, grid_c, h, w] -> [*shape], dropping padding."""
        # [gr, gc, h, w] -> [gr, h, gc, w] -> [R, C]
        m = chunks.permute(0, 2, 1, 3).reshape(self.padded_rows, self.padded_cols)
        return self.crop(m)
