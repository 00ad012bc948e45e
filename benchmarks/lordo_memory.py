"""Optimizer-state memory per matrix parameter: LoRDO vs AdamW's two full-size moments.

    python benchmarks/lordo_memory.py [--rank 256] [--measure]

For each p x q shape (GPT-2-small / LLaMA-7B-like projections) the table gives, in
elements: AdamW's moments (2pq); LoRDO's low-rank moments u, v (p x r or r x q each) plus
its basis Q; and, stated honestly, LoRDO's full-size buffers that are not moments: the
anchor θ₀ (pq, needed to form the synced delta; DiLoCo keeps the same) and the projection
error E (pq; error_feedback=False drops it). With --measure the LoRDO column is summed
from a real optimizer's state after one step (shapes up to 1024 x 4096), not computed.
"""

from __future__ import annotations

import argparse

import torch

from thinwire.ops import lowrank
from thinwire.optim.lordo import LoRDO

SHAPES = [(768, 768), (3072, 768), (768, 3072), (1024, 4096), (4096, 4096), (11008, 4096), (4096, 11008)]
MEASURE_LIMIT = 1024 * 4096


def formula(shape, rank):
    r = min(rank, *shape)
    lp, lq = lowrank.low_rank_shape(shape, r)
    return 2 * lp * lq, lowrank.basis_size(shape) * r


def measured(shape, rank):
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = LoRDO([p], rank=rank, sync_every=10**9)
    p.grad = torch.randn(shape)
    opt.step()
    s = opt.state[p]
    return s["exp_avg"].numel() + s["exp_avg_sq"].numel(), s["Q"].numel(), s["error"].numel() + s["anchor"].numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--measure", action="store_true", help="sum a real optimizer's state (small shapes)")
    args = ap.parse_args()
    print(f"rank r = {args.rank}; elements per matrix parameter (fp32: x4 bytes)\n")
    print("| p x q | AdamW moments 2pq | LoRDO u+v | LoRDO Q | moments+Q / 2pq | LoRDO E + anchor (full size) | source |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for shape in SHAPES:
        p, q = shape
        moments, basis = formula(shape, args.rank)
        full, source = 2 * p * q, "formula"
        if args.measure and p * q <= MEASURE_LIMIT:
            moments, basis, full = measured(shape, args.rank)
            source = "measured"
        print(f"| {p} x {q} | {2 * p * q:,} | {moments:,} | {basis:,} | {(moments + basis) / (2 * p * q):.3f} "
              f"| {full:,} | {source} |")


if __name__ == "__main__":
    main()
