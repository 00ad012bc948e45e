"""The k largest of each row in one read of the row: a Triton kernel for CUDA float32 rows.

torch's CUDA top-k selects a row of n values by radix select, two bits a pass: 16 passes over
the row for float32, and the chunked compressors' rows (4,096 coefficients of a 64 × 64
chunk) are where DeMo's GPU step spent most of its time (18 of ~67 ms of kernels at 1.3B
parameters on an H200). Here one program holds one row in registers and finds the k-th
largest value bit by bit, then writes the k indices in ascending order (on an H200, 317,376
rows of 4,096: 12.6 ms against torch's 18.7 and the two-level selection's 14.1 with k = 32;
12.7, 19.0 and 17.5 with k = 64; still ten times the 1.2 ms of reading the rows once: the
31 block-wide counts, not the memory, bound it):

    keys  = bits(|x|) as int32          (non-negative float32 orders as its bit pattern)
    t     = the largest τ with #{keys ≥ τ} ≥ k, built from the top bit down (31 counts)
    take  = keys > t, then the first k − #{keys > t} of keys == t in index order

The set is topk's except among values equal to the k-th largest, where this kernel takes the
lowest indices (torch's CUDA top-k leaves that choice unspecified). Rows of up to
`MAX_ROW` values; `largest_indices` falls back to torch for anything else.

Imported only where a CUDA tensor meets an installed Triton (an optional dependency: the
CUDA builds of torch ship it), so that nothing here runs on a CPU-only install.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

MAX_ROW = 16384            # one row in one program's registers: 16,384 float32 over 16 warps
MAX_K = 2 ** 20
# warps a 4,096-value row: on an H200, 317,376 rows with k = 32 took 17.8 / 22.1 / 14.9 / 12.6 /
# 27.6 ms at 1 / 2 / 4 / 8 / 16 warps (benchmarks/gpu_topk.py)
DEFAULT_WARPS = 8


@triton.jit
def largest_slots(keys, k):
    """keys [B] int32 (≥ 0; -1 never taken) -> (take [B] bool: the k largest, ties at the k-th
    by lowest index; slot [B] int32: each taken key's place in ascending index order)."""
    # t: the k-th largest key, one bit at a time from the top (bit 31 is the sign: always 0)
    t = tl.zeros((), dtype=tl.int32)
    for bit in tl.static_range(30, -1, -1):
        candidate = t | (1 << bit)
        count = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        t = tl.where(count >= k, candidate, t)
    above = keys > t
    ties = keys == t
    room = k - tl.sum(above.to(tl.int32), axis=0)                 # how many ties are taken
    take = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= room))
    return take, tl.cumsum(take.to(tl.int32), axis=0) - 1


@triton.jit
def _row_largest_kernel(keys_ptr, out_ptr, n, k, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    # int32 image of non-negative float32; the sign bit cleared (−0.0 -> 0); -1 pads the block
    keys = tl.load(keys_ptr + row * row_stride + offs, mask=inside, other=-1)
    take, slot = largest_slots(tl.where(inside, keys & 0x7FFFFFFF, -1), k)
    tl.store(out_ptr + row * k + slot, offs.to(tl.int64), mask=take)


def supported(magnitude: torch.Tensor, k: int) -> bool:
    """Whether `row_largest` takes this input: a CUDA float32 tensor whose last dim is
    contiguous, rows of 1..MAX_ROW values, 1 <= k <= the row."""
    n = magnitude.shape[-1] if magnitude.dim() else 0
    return (magnitude.is_cuda and magnitude.dtype == torch.float32 and 0 < n <= MAX_ROW
            and 1 <= k <= n and k <= MAX_K and magnitude.stride(-1) == 1)


def row_largest(magnitude: torch.Tensor, k: int, num_warps: int | None = None) -> torch.Tensor:
    """[*, n] non-negative float32 -> [*, k] int64: each row's k largest, ascending indices.
    num_warps: warps per row (default `DEFAULT_WARPS`, fewer for short rows); with one warp a
    row's counts are warp shuffles alone, with more they meet in shared memory."""
    n = magnitude.shape[-1]
    rows = magnitude.reshape(-1, n)                                 # [R, n]: a view where strides allow; stride(-1) stays 1
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=magnitude.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        warps = num_warps or max(1, min(DEFAULT_WARPS, block // 512))
        on = torch.cuda.device(magnitude.device) if magnitude.is_cuda else contextlib.nullcontext()
        with on:                                                    # Triton launches on the current device
            _row_largest_kernel[(rows.shape[0],)](rows.view(torch.int32), out, n, k, rows.stride(0),
                                                  BLOCK=block, num_warps=warps)
    return out.view(*magnitude.shape[:-1], k)
