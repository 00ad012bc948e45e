"""The median-norm clip of each sender's contribution (Templar's guard against one bad peer),
for DeMo and SparseLoCo (`clip='median-norm'`). Per tensor t and delivered sender s:

    n_{s,t} = ‖Q̂_{s,t}‖₂                       the norm of what s sent for t
    m_t     = lower median_s n_{s,t}              over the senders whose rows the round
                                                  delivered (torch.median: of an even count
                                                  the lower of the middle two)
    c_{s,t} = min(1, m_t / n_{s,t})              1 where n_{s,t} <= m_t (and where n_{s,t} = 0)
    Q̂_{s,t} ← c_{s,t} Q̂_{s,t}                    before the aggregate (mean or senders)

so no sender's contribution to a tensor is longer than the median sender's, and one message
1000x too long moves the aggregate by at most m_t / W (W delivered senders) in its direction.
Templar's gather computes the same per parameter tensor and per peer: the L2 norm of the
peer's sparse values, `torch.median` of those norms (the lower median), and a scale of
min(1, median / (norm + 1e-8)), not a drop; here the comparison is exact instead of the 1e-8,
so a contribution at or below the median is left exactly as sent.

The norms come from the sparse values alone, with no decode: DeMo's transforms ('dct', the
chunked orthonormal DCT-II; 'identity'; 'random', an orthogonal Haar basis) are orthonormal
and the top-k indices of a chunk are distinct, so ‖T⁻¹(Q̂)‖ over the (padded) tensor equals
‖values‖ (Parseval); SparseLoCo's grouped path keeps the values themselves (transform
'identity'). A padded tensor's norm includes what lands in its padding (cropped later), as
Templar's norm of the sent values does. Everything runs on the device, one segmented sum
for all of a group's tensors (deterministic: `segment_sums`) and no host read; every rank
clips the same rows alike, so replicas stay bit-identical. Under FSDP2 inside a site a
tensor is this rank's shard (each shard's message is exchanged, and clipped, on its own).
"""

from __future__ import annotations

import torch

CLIPS = (None, "median-norm")


def check_clip(clip) -> str | None:
    """ValueError naming `clip` unless it is None (off) or 'median-norm'."""
    if clip is not None and (not isinstance(clip, str) or clip not in CLIPS):
        raise ValueError(f"clip must be one of {CLIPS}, got {clip!r}")
    return clip


def factors(squares: torch.Tensor) -> torch.Tensor:
    """c [W, T] = min(1, m_t / n_{s,t}) from the squared norms [W, T] (senders × tensors), the
    median over the senders (dim 0, the lower one for an even W)."""
    norms = squares.sqrt()
    median = norms.median(dim=0).values                      # [T]
    # where n > m (so n > 0): m / n < 1; elsewhere exactly 1 (no division by a zero norm)
    return torch.where(norms > median, median / norms, 1.0)


def segment_sums(squares: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-tensor sums of each sender's row: squares [W, N], a row the tensors' entries end to
    end, `lengths` [T] int64 on the device (each >= 1) -> [W, T]. One segmented reduction,
    each segment summed in element order: no float atomics (an index_add_ of many entries
    into one slot adds in the order its atomics land on a GPU, and ranks would then clip by
    factors that differ in the last bit)."""
    world = squares.shape[0]
    sums = torch.segment_reduce(squares.reshape(-1), "sum", lengths=lengths.repeat(world), unsafe=True)
    return sums.view(world, -1)


def clip_rows(values: torch.Tensor, segment: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """values [W, N] with each sender's values of tensor t scaled by c_{s,t} (module
    docstring): segment [N] int64 each value's tensor, `lengths` [T] the tensors' value counts
    (their values contiguous, in tensor order). A new tensor: the decoded rows stay as they are."""
    c = factors(segment_sums(values.square(), lengths))
    return values * c.gather(1, segment.expand(values.shape[0], -1))


def clip_chunks(values: torch.Tensor, chunk_tensor: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """DeMo's grouped values [W, chunks, k]: chunk_tensor [chunks] each chunk's tensor,
    `lengths` [T] the tensors' chunk counts; each sender's chunks of tensor t scaled by c_{s,t}."""
    c = factors(segment_sums(values.square().sum(-1), lengths))          # Σ over chunks of Σ_k v²
    return values * c.gather(1, chunk_tensor.expand(values.shape[0], -1)).unsqueeze(-1)


def clip_reads(reads: list[tuple]) -> list[tuple]:
    """One tensor's senders' reads [(indices, values), ...] (DeMo's per-tensor path), each
    sender's values scaled by its c_s; the indices kept."""
    squares = torch.stack([v.float().square().sum() for _, v in reads]).unsqueeze(1)    # [W, 1]
    c = factors(squares)
    return [(idx, v * c[s, 0].to(v.dtype)) for s, (idx, v) in enumerate(reads)]
