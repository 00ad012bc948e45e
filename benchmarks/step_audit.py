"""Kernel launches and host reads of one optimizer step, counted on CPU as a GPU would see
them (`thinwire.audit.StepAudit`), at world 2 on GPT-2-shaped parameters.

    python benchmarks/step_audit.py [--blocks 2,8] [--width 64] [--vocab 512] [--context 64]
        [--optimizers torch-adamw-foreach,...] [--world 2] [--json out.json]

Two real gloo processes; each optimizer takes warm-up steps until it is in its steady state
(a periodic method twice round its cycle, so a delayed sync is in flight), then every step of
one cycle is audited on its own. Printed per optimizer and block count: launches and host
reads per step (mean over the cycle, and the most expensive step: a periodic method's sync),
host values (tensors made from Python data), collectives, and the launches' growth per block.
The counts depend on the number and grouping of tensors, not their sizes, so the default
widths are narrow (GPT-2 small's 12 blocks at width 768 give the same counts per block);
`--width 768 --vocab 50257 --context 1024` audits the real shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from step_configs import CONFIGS, gpt2_shapes, make_params, new_gradients

from thinwire.audit import StepAudit

WARMUP_CYCLES = 2


def audit_config(name: str, shapes, rank: int) -> dict:
    """Per-step counts of one cycle of `name` in its steady state, on this rank."""
    config = CONFIGS[name]
    params = make_params(shapes)
    opt = config.build(params, None)
    warmup = max(8, WARMUP_CYCLES * config.period)          # APMSqueeze's 5 dense steps, overlap's first
    for step in range(warmup):
        new_gradients(params, step, rank)
        opt.step()
    steps = []
    for step in range(warmup, warmup + config.period):
        new_gradients(params, step, rank)
        audit = StepAudit(host_tensors=StepAudit.host_steps(opt))
        with audit:
            opt.step()
        steps.append(audit.summary())
    if hasattr(opt, "flush"):
        opt.flush()
    return {"steps": steps}


def _worker(rank: int, world: int, root: str, names: list[str], blocks: list[int], sizes: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    out = {}
    for b in blocks:
        shapes = gpt2_shapes(b, **sizes)
        for name in names:
            out[f"{name}@{b}"] = audit_config(name, shapes, rank)
    if rank == 0:
        torch.save(out, os.path.join(root, "audit.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _row(name: str, by_blocks: dict[int, dict]) -> str:
    cells = []
    for b, result in by_blocks.items():
        steps = result["steps"]
        launches = [s["launches"] for s in steps]
        reads = [s["host_reads"] for s in steps]
        mean = sum(launches) / len(launches)
        cells += [f"{mean:,.0f}", f"{max(launches):,}", f"{sum(reads) / len(reads):.1f}", f"{max(reads)}",
                  f"{max(s['host_values'] for s in steps)}", f"{max(s['collectives'] for s in steps)}"]
    (b0, r0), (b1, r1) = list(by_blocks.items())[0], list(by_blocks.items())[-1]
    mean0 = sum(s["launches"] for s in r0["steps"]) / len(r0["steps"])
    mean1 = sum(s["launches"] for s in r1["steps"]) / len(r1["steps"])
    growth = (mean1 - mean0) / (b1 - b0) if b1 != b0 else 0.0
    return f"| {name} | " + " | ".join(cells) + f" | {growth:+,.1f} | {mean1 / max(mean0, 1):.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="2,8", help="block counts, comma-separated (default 2,8)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--optimizers", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS))
    parser.add_argument("--json", default=None, help="also write every step's counts here")
    parser.add_argument("--top", action="store_true", help="print each optimizer's most frequent operators")
    args = parser.parse_args()
    names, blocks = args.optimizers.split(","), [int(b) for b in args.blocks.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown optimizers {unknown}; known: {', '.join(CONFIGS)}")
    sizes = dict(width=args.width, vocab=args.vocab, context=args.context)
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(_worker, args=(args.world, root, names, blocks, sizes), nprocs=args.world, join=True)
        out = torch.load(os.path.join(root, "audit.pt"), weights_only=False)
    print(f"world {args.world}, GPT-2 shapes at width {args.width}, vocab {args.vocab}, context {args.context}; "
          f"per step() of rank 0 (mean over a cycle / its costliest step)\n")
    head = " | ".join(f"{b} blocks: launches mean | max | host reads mean | max | host values | collectives"
                      for b in blocks)
    print(f"| optimizer | {head} | launches per block | growth {blocks[0]}->{blocks[-1]} |")
    print("|---" * (1 + 6 * len(blocks) + 2) + "|")
    for name in names:
        print(_row(name, {b: out[f"{name}@{b}"] for b in blocks}))
    if args.top:
        for name in names:
            worst = max(out[f"{name}@{blocks[-1]}"]["steps"], key=lambda s: s["launches"])
            print(f"\n{name} at {blocks[-1]} blocks, costliest step: launches {worst['launch']}\n"
                  f"  host reads {worst['host_read']}\n  host values {worst['host_value']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
