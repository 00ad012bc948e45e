"""What SparseLoCo's sync encode is made of, part by part, on a preset's parameter shapes.

    python benchmarks/sparseloco_encode_parts.py [--preset wan] [--topk 32] [--chunk 32]
                                                 [--indices elias-fano] [--repeats 21]

One process, one torch thread (as each of the harness's `wan` workers runs), random values of
the parameters' shapes; each line is the median of `repeats` calls over every parameter (the
first call dropped). The first line is the whole compressor as the sync runs it
(`FlatSparseLoCo`: every tensor's |x| staged, one top-k per group, each tensor's encode, then
the groups' bytes), the second the same with each tensor's top-k on its own; the lines under
them time its parts alone, on the same chunks (one call per tensor):
|x| in chunk-major order, the exact top-k of every chunk (`ops.select.largest_indices`), the
ascending sort Elias-Fano needs (`ops.ascending`), the 2-bit quantizer and the packing
(`write`). The optimizer adds Δ = θ₀ − θ and e = β e + Δ (two passes), three full copies for
the eager jump, and on every step the finiteness check of the gradients (`all_finite`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from thinwire.compress import SparseLoCoTopK
from thinwire.compress.sparseloco_flat import FlatSparseLoCo
from thinwire.ops.select import ascending, largest_indices
from thinwire.optim.protocol import all_finite
from thinwire.train.config import get_preset
from thinwire.train.model import build_model
from thinwire.wire.twobit import quantize_rows


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def chunk_major(flat: FlatSparseLoCo, xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Each grouped tensor's chunks: (x viewed chunk-major, |x| written there [chunks, chunk
    elements], its k, its chunk elements)."""
    out = []
    for i, x in enumerate(xs):
        if i not in flat.place:
            continue
        group, j = flat.place[i]
        (gr, gc), h, w = group.plans[j].grid, group.h, group.w
        view = x.view(gr, h, gc, w).permute(0, 2, 1, 3)           # [R, C] -> [gr, gc, h, w], strided
        magnitude = torch.empty(gr * gc, h * w)
        torch.abs(view, out=magnitude.view(gr, gc, h, w))
        out.append((view, magnitude, group.k, h * w))
    return out


def parts(args) -> dict[str, float]:
    torch.set_num_threads(1)
    xs = [torch.randn(p.shape) * 1e-3 for p in build_model(get_preset(args.preset)).parameters()]
    flat = FlatSparseLoCo(SparseLoCoTopK(args.topk, args.chunk, indices=args.indices), [x.shape for x in xs], "cpu")
    payload = torch.empty(flat.nbytes, dtype=torch.uint8)
    chunks = chunk_major(flat, xs)
    kept = [largest_indices(m, k) for _, m, k, _ in chunks]
    values = [torch.randn(1, idx.numel()) for idx in kept]
    anchors, errors, out = [x.clone() for x in xs], [x.clone() for x in xs], [torch.empty_like(x) for x in xs]

    def encode(staged: bool):
        if staged:
            for i, x in enumerate(xs):
                flat.stage(i, x)
            flat.select()
        for i, x in enumerate(xs):
            flat.encode(i, x, payload)
        flat.write(payload)

    r = args.repeats
    return {
        "encode, all of it (`FlatSparseLoCo`, staged: the sync's path)": median_ms(lambda: encode(True), r),
        "encode, each tensor's top-k on its own": median_ms(lambda: encode(False), r),
        "  |x| in chunk-major order": median_ms(
            lambda: [torch.abs(v, out=m.view(v.shape)) for v, m, _, _ in chunks], r),
        "  exact top-k of every chunk": median_ms(lambda: [largest_indices(m, k) for _, m, k, _ in chunks], r),
        "  each chunk's indices ascending (Elias-Fano only)": median_ms(
            lambda: [ascending(idx, n) for idx, (_, _, _, n) in zip(kept, chunks)], r),
        "  2-bit quantizer": median_ms(lambda: [quantize_rows(v) for v in values], r),
        "  packing (`write`)": median_ms(lambda: flat.write(payload), r),
        "optimizer: Δ = θ₀ − θ, e = β e + Δ": median_ms(
            lambda: [torch.sub(a, x, out=o).add_(e, alpha=0.95) for a, x, e, o in zip(anchors, xs, errors, out)], r),
        "optimizer: one full copy (the eager jump makes three)": median_ms(
            lambda: [o.copy_(x) for o, x in zip(out, xs)], r),
        "every step: the gradients' finiteness check": median_ms(lambda: all_finite(xs), r),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="wan")
    parser.add_argument("--topk", type=int, default=32, help="values kept per chunk (default 32)")
    parser.add_argument("--chunk", type=int, default=32, help="target chunk side (default 32)")
    parser.add_argument("--indices", default="elias-fano", help="packed | elias-fano (default)")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    n = sum(p.numel() for p in build_model(get_preset(args.preset)).parameters())
    print(f"SparseLoCo's encode on `{args.preset}` ({n / 1e6:.2f}M parameters), top-{args.topk} of "
          f"{args.chunk} x {args.chunk}, indices {args.indices}, one thread, median of {args.repeats - 1}\n")
    print("| part | ms |\n|---|---|")
    for name, ms in parts(args).items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
