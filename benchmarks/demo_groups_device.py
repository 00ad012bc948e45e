"""DeMo's grouped path against its per-tensor path on one device (a GPU when at hand): the
largest parameter difference after a few steps at GPT-2 shapes, and whether the messages agree.

    python benchmarks/demo_groups_device.py [--device cuda] [--blocks 2] [--steps 5]

On CPU the two agree bit for bit (tests/optim/test_demo_groups.py); on a GPU a GEMM over more
rows may sum in another order and top-k over more rows break ties otherwise: this prints how far.
"""

from __future__ import annotations

import argparse

import torch
from step_configs import gpt2_shapes

import thinwire


def run(grouped: bool, shapes, device: str, steps: int):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]
    opt = thinwire.DeMo(params, lr=1e-4, topk=32, chunk=64)
    opt.grouped = grouped
    grads = torch.Generator().manual_seed(1)
    sent = []
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=grads) * 1e-3).to(device)
        opt.step()
        sent.append(opt._messages[opt.steps_done % 2].buffer.clone())
    return params, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    shapes = gpt2_shapes(args.blocks, width=args.width)
    ours, sent = run(True, shapes, args.device, args.steps)
    ref, ref_sent = run(False, shapes, args.device, args.steps)
    diff = max((p - q).abs().max().item() for p, q in zip(ours, ref))
    moved = sum(int((p != q).sum()) for p, q in zip(ours, ref))
    same = [torch.equal(a, b) for a, b in zip(sent, ref_sent)]
    print(f"{args.device}: {len(shapes)} tensors, {args.steps} steps: largest parameter difference {diff:.3g} "
          f"({moved} elements differ); messages equal per step: {same}")


if __name__ == "__main__":
    main()
