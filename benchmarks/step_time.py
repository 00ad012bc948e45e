"""DeMo.step() against torch.optim.AdamW(foreach=True).step() on the same parameters.

    python benchmarks/step_time.py [--model gpt2-small] [--k 32] [--rounds 3] [--steps 3] [--layers 12]

World size 1 (no process group: the message is built, "gathered" locally and decoded, so
the compute of a real step is all there). Every measurement runs in a fresh Python process
(one warm-up step, then `--steps` timed steps), and the optimizers take turns, round by
round. Separate processes matter on CPU: glibc's malloc adapts its mmap threshold to what
a process has freed before, so an optimizer timed in a process where another ran first can
pay (or be spared) the page faults of its temporaries, which moved AdamW's step by 2x in
one shared process. Prints the median and the minimum seconds per step of each and their
ratios to AdamW, for DeMo with its momentum kept as parameters (the reference's
arithmetic) and as transform coefficients (momentum_domain='transform').
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from shapes import MODELS, gpt2_small

import thinwire

OPTIMIZERS = ("AdamW foreach", "DeMo momentum_domain='param'", "DeMo momentum_domain='transform'")


def make_params(shapes) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def model_shapes(args) -> list[tuple[int, ...]]:
    if args.model == "gpt2-small":
        return gpt2_small()[: 2 + 12 * args.layers] + gpt2_small()[-2:]
    return MODELS[args.model]()


def build(name: str, params, args) -> torch.optim.Optimizer:
    if name == "AdamW foreach":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    domain = name.split("'")[1]
    return thinwire.DeMo(params, lr=1e-4, topk=args.k, values=args.values, momentum_domain=domain)


def time_in_this_process(name: str, args) -> list[float]:
    """Seconds of each of `args.steps` steps after one warm-up step (which allocates state)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    opt = build(name, make_params(model_shapes(args)), args)
    opt.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def time_in_fresh_process(name: str, argv: list[str]) -> list[float]:
    done = subprocess.run([sys.executable, __file__, *argv, "--worker", name],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--values", default="bf16")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per optimizer")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers to keep (gpt2-small only)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--worker", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(time_in_this_process(args.worker, args)))
        return
    argv = [a for a in sys.argv[1:]]
    times: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
    for _ in range(args.rounds):
        for name in OPTIMIZERS:
            times[name] += time_in_fresh_process(name, argv)
    numel = sum(torch.Size(s).numel() for s in model_shapes(args))
    print(f"model {args.model} ({numel / 1e6:.1f}M params), k={args.k}, values={args.values}, "
          f"threads={args.threads or torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps, "
          "each optimizer in a fresh process per round")
    print("| optimizer | median s/step | ratio | min s/step | ratio |")
    print("|---|---|---|---|---|")
    base = times["AdamW foreach"]
    for name, t in times.items():
        med, low = statistics.median(t), min(t)
        print(f"| {name} | {med:.3f} | {med / statistics.median(base):.2f} | {low:.3f} | {low / min(base):.2f} |")


if __name__ == "__main__":
    main()
