"""Top-k selection of non-negative scores, the one sort-like step on the compressors' hot path."""

from __future__ import annotations

import torch


def largest_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim of a non-negative tensor, in no
    particular order: `magnitude.topk(k, dim=-1, sorted=False).indices`.

    Non-negative float32 values (inf and NaN included; -0.0 excluded, which |x| never gives)
    order exactly as their IEEE-754 bit patterns read as int32, and torch's CPU top-k is
    about 20 % faster on int32 than on float32 (4.7 vs 5.9 ns per element, one thread, rows
    of 4096, k = 58). Among equal values the choice may differ from the float path's.
    """
    if magnitude.dtype == torch.float32 and magnitude.device.type == "cpu" and magnitude.is_contiguous():
        magnitude = magnitude.view(torch.int32)
    return magnitude.topk(k, dim=-1, sorted=False).indices
