"""A prototype for benchmarks/gpu_topk.py: the chunk transform P X Pᵀ and the top-k of its
magnitudes in one Triton program per 64 × 64 chunk, so the coefficient image is never
written. Not used by the library: it measures what fusing would save before the library
commits to it (its sums run in another order than cuBLAS's, so it is not bit for bit the
grouped path)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thinwire.ops.select_triton import largest_slots


@triton.jit
def _dct_select_kernel(x_ptr, p_ptr, idx_ptr, val_ptr, cols, chunk_cols, k,
                       CHUNK: tl.constexpr, PREC: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    a, b = chunk // chunk_cols, chunk % chunk_cols
    i = tl.arange(0, CHUNK)
    x = tl.load(x_ptr + (a * CHUNK + i[:, None]) * cols + b * CHUNK + i[None, :])   # X: [64, 64]
    p = tl.load(p_ptr + i[:, None] * CHUNK + i[None, :])                             # P: [64, 64]
    p_t = tl.load(p_ptr + i[None, :] * CHUNK + i[:, None])                           # Pᵀ
    y = tl.dot(tl.dot(p, x, input_precision=PREC), p_t, input_precision=PREC)       # P X Pᵀ
    flat = tl.reshape(y, [CHUNK * CHUNK])                                            # row-major within the chunk
    take, slot = largest_slots(tl.abs(flat).to(tl.int32, bitcast=True), k)
    pos = tl.arange(0, CHUNK * CHUNK)
    tl.store(idx_ptr + chunk * k + slot, pos.to(tl.int64), mask=take)
    tl.store(val_ptr + chunk * k + slot, flat, mask=take)


def fused_dct_select(image: torch.Tensor, p: torch.Tensor, k: int, precision: str = "ieee"):
    """image [R, C] float32 (R, C multiples of 64), p [64, 64] -> (indices [chunks, k] int64
    within each chunk, row-major; values [chunks, k] float32), chunks row-major over the grid."""
    rows, cols = image.shape
    chunk = p.shape[0]
    n = (rows // chunk) * (cols // chunk)
    idx = torch.empty(n, k, dtype=torch.int64, device=image.device)
    vals = torch.empty(n, k, dtype=torch.float32, device=image.device)
    _dct_select_kernel[(n,)](image, p.contiguous(), idx, vals, cols, cols // chunk, k,
                             CHUNK=chunk, PREC=precision, num_warps=8)
    return idx, vals
