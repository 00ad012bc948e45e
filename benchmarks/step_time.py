"""DeMo.step() against torch.optim.AdamW(foreach=True).step() on the same parameters.

    python benchmarks/step_time.py [--model gpt2-small] [--k 32] [--repeats 5] [--layers 12]

World size 1 (no process group: the message is built, "gathered" locally and decoded, so
the compute of a real step is all there). Steps of the three optimizers alternate, round
by round; prints the median and the minimum seconds per step of each and their ratios,
for DeMo with its momentum kept as parameters (the reference's arithmetic) and as
transform coefficients (momentum_domain='transform'). `--layers` trims GPT-2's depth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from shapes import MODELS, gpt2_small

import thinwire


def make_params(shapes) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def step_seconds(optimizers: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of each optimizer, measured round-robin (one step of each per round)
    so that a slow spell of a shared machine hits them all alike."""
    for opt in optimizers.values():
        opt.step()  # first step allocates state
    times = {name: [] for name in optimizers}
    for _ in range(repeats):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--values", default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers to keep (gpt2-small only)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = MODELS[args.model]()
    if args.model == "gpt2-small":
        shapes = gpt2_small()[: 2 + 12 * args.layers] + gpt2_small()[-2:]
    numel = sum(torch.Size(s).numel() for s in shapes)
    params = make_params(shapes)
    optimizers = {"AdamW foreach": torch.optim.AdamW(params, lr=1e-4, foreach=True)}
    for domain in ("param", "transform"):
        optimizers[f"DeMo momentum_domain={domain!r}"] = thinwire.DeMo(
            params, lr=1e-4, topk=args.k, values=args.values, momentum_domain=domain)
    times = step_seconds(optimizers, args.repeats)
    print(f"model {args.model} ({numel / 1e6:.1f}M params), k={args.k}, values={args.values}, "
          f"threads={torch.get_num_threads()}, {args.repeats} rounds, round-robin")
    print("| optimizer | median s/step | ratio | min s/step | ratio |")
    print("|---|---|---|---|---|")
    base = times["AdamW foreach"]
    for name, t in times.items():
        med, low = statistics.median(t), min(t)
        print(f"| {name} | {med:.3f} | {med / statistics.median(base):.2f} | {low:.3f} | {low / min(base):.2f} |")


if __name__ == "__main__":
    main()
