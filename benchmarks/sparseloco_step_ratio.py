"""SparseLoCo's training step against dense AdamW's, in the same processes, alternating.

    python benchmarks/sparseloco_step_ratio.py [--preset wan] [--sync-every 8] [--delay 6]
                                               [--topk 32] [--chunk 32] [--indices packed] [--blocks 24]

The harness divides SparseLoCo's time to target by AdamW's compute-only step, calibrated in
another run; on a shared CPU the machine's speed can move between runs. This script takes
both on the same two gloo ranks (one process and one torch thread each, as the harness runs
`wan` on 2 cores), alternating blocks of `sync_every` steps:
- torch AdamW under DDP with `no_sync()`: forward, backward, step, the harness's calibration;
- SparseLoCo (overlap, delay, eager), AdamW inside: forward, backward, step.
It prints the median of each step of SparseLoCo's round (local, landing, sync), AdamW's median
step, and the round's ratio: SparseLoCo's time per round over `sync_every` AdamW steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sparseloco_sync import join_gloo, on_two_ranks, round_arguments   # this folder's
from torch.nn.parallel import DistributedDataParallel

WARMUP_BLOCKS = 2


def _adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _step(forward, opt, x, y) -> float:
    start = time.perf_counter()
    F.cross_entropy(forward(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return time.perf_counter() - start


def _worker(rank: int, args, port: int, out) -> None:
    from thinwire import SparseLoCo
    from thinwire.train.config import get_preset
    from thinwire.train.data import train_batch
    from thinwire.train.model import build_model
    join_gloo(rank, port)
    cfg, h = get_preset(args.preset), args.sync_every
    ids = torch.randint(0, cfg.vocab_size, (200_000,), generator=torch.Generator().manual_seed(0))
    ddp = DistributedDataParallel(build_model(cfg))
    dense = _adamw(ddp.parameters(), 3e-4)
    model = build_model(cfg)
    sparse = SparseLoCo(model.parameters(), inner=lambda ps: _adamw(ps, 6e-4), sync_every=h, overlap=True,
                        delay=args.delay, topk=args.topk, chunk=args.chunk, indices=args.indices)
    adamw, rounds, step = [], {i: [] for i in range(h)}, 0
    for block in range(args.blocks + WARMUP_BLOCKS):
        for _ in range(h):
            x, y = train_batch(ids, cfg, step, rank, 2)
            step += 1
            with ddp.no_sync():
                t = _step(ddp, dense, x, y)
            if block >= WARMUP_BLOCKS:
                adamw.append(t)
        for i in range(h):                                   # i = h − 1: the sync step
            x, y = train_batch(ids, cfg, step, rank, 2)
            step += 1
            t = _step(model, sparse, x, y)
            if block >= WARMUP_BLOCKS:
                rounds[i].append(t)
    if rank == 0:
        out.put((adamw, rounds))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    round_arguments(parser, topk=32, chunk=32)
    parser.add_argument("--blocks", type=int, default=24, help="timed rounds of each (after 2 of warm-up)")
    args = parser.parse_args()
    adamw, rounds = on_two_ranks(_worker, args)
    h = args.sync_every
    sync, landing = h - 1, (h - 1 + args.delay) % h
    by_step = [statistics.median(rounds[i]) for i in range(h)]
    print(f"`{args.preset}`, 2 ranks on gloo, H {h}, delay {args.delay}, top-{args.topk} of {args.chunk} x "
          f"{args.chunk}; {args.blocks} alternating rounds, rank 0, medians\n")
    print("| step | ms |\n|---|---|")
    print(f"| AdamW (DDP, communication off) | {1e3 * statistics.median(adamw):.1f} |")
    for i, t in enumerate(by_step):
        what = "sync" if i == sync else "landing" if i == landing else "local"
        print(f"| SparseLoCo step {i + 1} of the round ({what}) | {1e3 * t:.1f} |")
    ratio = sum(by_step) / (h * statistics.median(adamw))
    print(f"| **a round: SparseLoCo / AdamW** | **{1e3 * sum(by_step):.1f} / "
          f"{1e3 * h * statistics.median(adamw):.1f} = {ratio:.3f}** |")


if __name__ == "__main__":
    main()
