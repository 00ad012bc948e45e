"""Newton-Schulz orthogonalisation time on CPU for GPT-2-small's matrix shapes.

    python benchmarks/newton_schulz_time.py [--repeats 5] [--threads N]

EF21-Muon's server runs one orthogonalisation (5 quintic Newton-Schulz steps, bf16) per
matrix per step: this is its main compute beyond the compressors. For each distinct
attention/MLP shape of GPT-2 small (embeddings, head, norms and biases take a sign/RMS LMO
instead) it prints the median milliseconds of `thinwire.ops.orthogonalize` and of
torch.optim.Muon's own routine on the same input, per call and per NS step, and the total
per optimizer step over all 48 matrices. Timings on a shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from shapes import gpt2_small
from torch.optim._muon import _zeropower_via_newtonschulz

from thinwire.ops import NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalize


def median_ms(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)  # warm-up: allocations, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = Counter(s for s in gpt2_small()[2:] if len(s) == 2)      # skip token/position embeddings
    reference = lambda g: _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, NS_STEPS, NS_EPS)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    print(f"threads: {torch.get_num_threads()}, {NS_STEPS} NS steps in bf16, median of {args.repeats}\n")
    print("| shape | count | thinwire ms/call | ms per NS step | torch Muon ms/call | same bits |")
    print("|---|---:|---:|---:|---:|:---:|")
    total = total_ref = 0.0
    for shape, count in shapes.items():
        g = torch.randn(shape, generator=gen)
        ours, ref = median_ms(orthogonalize, g, args.repeats), median_ms(reference, g, args.repeats)
        same = torch.equal(orthogonalize(g), reference(g))
        total, total_ref = total + count * ours, total_ref + count * ref
        print(f"| {shape[0]}x{shape[1]} | {count} | {ours:.1f} | {ours / NS_STEPS:.1f} | {ref:.1f} "
              f"| {'yes' if same else 'NO'} |")
    print(f"| **per optimizer step** | {sum(shapes.values())} | **{total:.0f}** | {total / NS_STEPS:.0f} | "
          f"**{total_ref:.0f}** | |")


if __name__ == "__main__":
    main()
