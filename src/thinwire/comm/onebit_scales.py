"""Which elements share a scale in the 1-bit all-reduce (`thinwire.comm.collectives`): the
granularity of its two compressions. Each chunk message carries S float32 scales, the same S
on every rank (a function of the layout), after its header:

    ChunkScales    S = 1: one RMS per chunk of N / W elements, the worker's and the server's
                   (thinwire's default): scales span tensors, small tensors lean on error feedback
    TensorScales   DeepSpeed's granularity: the worker scale of each parameter tensor is the RMS
                   of its whole y_k = x_k + e_w,k; the server scale of each tensor's part of the
                   server's chunk is that part's RMS. A chunk message carries one scale per tensor
                   part in it (the tensor's worker scale, or the server's), S = the most parts any
                   chunk holds (unused slots 0); the padding after the last tensor is a part of
                   its own (scale 0: it is always 0)

    worker(y [W, c]) -> [W, S]     the scales of chunk j's parts in row j
    server(z [1, c], rank) -> [1, S]
    spread(s [R, S], chunk) -> broadcastable against [R, c]: each element's scale (chunk None:
                   row j is chunk j; else every row is that chunk)
"""

from __future__ import annotations

import math

import torch


def rms_scales(y: torch.Tensor, workspace: dict | None = None) -> torch.Tensor:
    """||y_r||_2 / sqrt(cols) per row of y [rows, cols], float32, with no host read. Each row is
    divided by p_r, the power of two at or below its largest magnitude (at least 2^-126), and
    multiplied back after the norm: both exact, so the result is the plain norm's bit for bit
    wherever that neither overflows (above ~1e19) nor underflows (below ~1e-19), and finite
    there too. A non-finite row gives a non-finite scale."""
    rows, cols = y.shape
    peak = torch.linalg.vector_norm(y, float("inf"), dim=1)                     # [rows] max |y_r|
    # p = 2^floor(log2 peak): peak's exponent bits alone (0x7F800000), at least 2^-126
    p = peak.view(torch.int32).bitwise_and_(0x7F800000).view(torch.float32).clamp_min_(2.0 ** -126)
    rel = None if workspace is None else workspace.get("rel")
    if rel is None or rel.shape != y.shape or rel.device != y.device:
        rel = torch.empty(rows, cols, dtype=torch.float32, device=y.device)
        if workspace is not None:
            workspace["rel"] = rel
    # y_r / p_r, exact: its largest magnitude is in [1, 2)
    torch.div(y, p[:, None], out=rel)
    # s_r = ||y_r / p_r|| · p_r / sqrt(cols)
    return torch.linalg.vector_norm(rel, dim=1).mul_(p).div_(math.sqrt(cols))


class ChunkScales:
    """One scale per chunk (S = 1)."""

    count = 1
    name = "chunk"

    def worker(self, y: torch.Tensor, workspace: dict | None = None) -> torch.Tensor:
        return rms_scales(y, workspace).view(-1, 1)

    def server(self, z: torch.Tensor, rank: int, workspace: dict | None = None) -> torch.Tensor:
        return rms_scales(z, workspace).view(1, 1)

    def spread(self, scales: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        return scales                                                  # [R, 1]: broadcast along the chunk


class TensorScales:
    """One scale per parameter tensor (worker) and per tensor part of a chunk (server)."""

    name = "tensor"

    def __init__(self, sizes: list[int], world: int, numel: int, device):
        if any(s <= 0 for s in sizes) or sum(sizes) > numel or numel % world:
            raise ValueError(f"sizes must be positive and fit in numel = {numel} (a multiple of world = {world}), "
                             f"got {sizes}")
        self.sizes = list(sizes) + ([numel - sum(sizes)] if numel > sum(sizes) else [])   # the padding: a part
        self.world, self.numel = world, numel
        parts = self._parts(numel // world)                            # per chunk: (tensor, length) in order
        self.count = max(len(p) for p in parts)
        dummy = len(self.sizes)                                        # unused slots: a scale of 0
        as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int64, device=device)
        self.slot_tensor = as_tensor([[t for t, _ in p] + [dummy] * (self.count - len(p)) for p in parts])  # [W, S]
        self.slot_lengths = as_tensor([[n for _, n in p] + [0] * (self.count - len(p)) for p in parts])    # [W, S]
        self.element_slot = as_tensor([[i for i, (_, n) in enumerate(p) for _ in range(n)] for p in parts])  # [W, c]
        self.lengths = as_tensor(self.sizes + [0])                     # [T + 1], the dummy empty
        self._counts = self.lengths.clamp_min(1).to(torch.float64)
        self._slot_counts = self.slot_lengths.clamp_min(1).to(torch.float64)

    def _parts(self, c: int) -> list[list[tuple[int, int]]]:
        parts, tensor, left = [], 0, self.sizes[0]
        for _ in range(self.world):
            chunk, room = [], c
            while room:
                take = min(room, left)
                chunk.append((tensor, take))
                room, left = room - take, left - take
                if not left and tensor + 1 < len(self.sizes):
                    tensor, left = tensor + 1, self.sizes[tensor + 1]
            parts.append(chunk)
        return parts

    def worker(self, y: torch.Tensor, workspace: dict | None = None) -> torch.Tensor:
        # s_k = sqrt(Σ_(i in k) y_i² / n_k), summed in float64 (no overflow or underflow from float32)
        squares = y.reshape(-1).to(torch.float64).square_()
        sums = torch.segment_reduce(squares, "sum", lengths=self.lengths, unsafe=True)      # [T + 1]
        per_tensor = sums.div_(self._counts).sqrt_().to(torch.float32)
        return per_tensor[self.slot_tensor]                                                 # [W, S]

    def server(self, z: torch.Tensor, rank: int, workspace: dict | None = None) -> torch.Tensor:
        squares = z.reshape(-1).to(torch.float64).square_()
        sums = torch.segment_reduce(squares, "sum", lengths=self.slot_lengths[rank], unsafe=True)  # [S]
        return sums.div_(self._slot_counts[rank]).sqrt_().to(torch.float32).view(1, self.count)

    def spread(self, scales: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        rows = scales.shape[0]
        slots = self.element_slot if chunk is None else self.element_slot[chunk].expand(rows, -1)   # [R, c]
        return torch.gather(scales, 1, slots)
