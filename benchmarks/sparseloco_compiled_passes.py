"""What torch.compile (inductor, C++ on CPU) would take off SparseLoCo's dense passes on `wan`.

    python benchmarks/sparseloco_compiled_passes.py [--preset wan] [--chunk 32] [--topk 32] [--repeats 30]

SparseLoCo's sync costs about 1.3 dense AdamW steps a round on `wan` (docs/results/
2026-11-26-sparseloco-round11.md); most of it is passes over every parameter. This script times,
on one torch thread, each pass group as the library writes it (torch ops, one tensor at a time)
against the same arithmetic compiled with `torch.compile(dynamic=False)` (the jump and the
landing: the library's in-place functions themselves; the front: the same values, fused), on the preset's
tensors that SparseLoCo chunks without padding:
- front: Δ = θ₀ − θ, e = β e + Δ, |e| chunk-major and the two-level selection's group maxima
  (`thinwire.ops.select`), the passes before the top-k;
- jump: the eager jump's copies (θ kept, θ ← θ₀, θ₀ − Δ̂ at the kept positions, θ_s kept);
- landing: θ₀ ← θ₀ − Δ̄, θ ← θ₀ + (θ − θ_s).
It prints the medians per sync (all tensors) and the one-off compile time. Nothing here is
used by the library.
"""

from __future__ import annotations

import argparse
import time

import torch
from apmsqueeze_bench import median_seconds   # this folder's

from thinwire.compress.sparseloco_topk import Sent
from thinwire.ops.select import _group_size
from thinwire.optim.sparseloco_sync import _difference, _subtract_sent

BETA = 0.95          # SparseLoCo's default error decay


def front_library(anchor, p, err, x, mag, h, w, g):
    """The library's passes: Δ into x, + β e, |x| chunk-major, group maxima (int32 view, g per group)."""
    rows, cols = p.shape
    _difference(anchor, p, out=x)
    x.add_(err, alpha=BETA)
    torch.abs(x.view(rows // h, h, cols // w, w).permute(0, 2, 1, 3), out=mag.view(rows // h, cols // w, h, w))
    return mag.view(torch.int32).view(-1, g, h * w // g).amax(dim=1)


def front_fused(anchor, p, err, h: int, w: int, g: int):
    rows, cols = p.shape
    x = anchor - p + BETA * err
    # [R, C] -> [gr, h, gc, w] -> [gr, gc, h, w] -> [chunks, g, h·w/g]
    mag = x.view(rows // h, h, cols // w, w).permute(0, 2, 1, 3).abs().reshape(-1, g, h * w // g)
    return x, mag.amax(dim=1)


def jump_library(p, anchor, kept, launched, positions, values):
    """SparseLoCo._encode's eager jump: θ kept, θ ← θ₀ − Δ̂ (`_subtract_sent`), θ_s kept."""
    kept.copy_(p)
    p.copy_(anchor)
    _subtract_sent(p, Sent(positions, values, None), 1.0)
    launched.copy_(p)


def landing_library(anchor, mean, p, launched):
    anchor.sub_(mean)
    p.sub_(launched).add_(anchor)


def _shapes(preset: str, chunk: int) -> list[tuple[int, int]]:
    from thinwire.train.config import get_preset
    from thinwire.train.model import build_model
    model = build_model(get_preset(preset))
    return [tuple(p.shape) for p in model.parameters()
            if p.ndim == 2 and p.shape[0] % chunk == 0 and p.shape[1] % chunk == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="wan")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--topk", type=int, default=32, help="values kept per chunk (sets the selection's groups)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    h = w = args.chunk
    g = _group_size(h * w, args.topk)
    shapes = _shapes(args.preset, args.chunk)
    tensors = [{name: torch.randn(shape) for name in ("anchor", "p", "err", "x", "mean", "kept", "launched")}
               for shape in shapes]
    for t, shape in zip(tensors, shapes):
        n = shape[0] * shape[1]
        t["mag"] = torch.empty(n)
        t["positions"] = torch.randperm(n)[: n * args.topk // (h * w)].sort().values
        t["values"] = torch.randn(t["positions"].numel())
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in
                (("front", front_fused), ("jump", jump_library), ("landing", landing_library))}
    cases = {
        "front": (lambda t: front_library(t["anchor"], t["p"], t["err"], t["x"], t["mag"], h, w, g),
                  lambda t: compiled["front"](t["anchor"], t["p"], t["err"], h, w, g)),
        "jump": (lambda t: jump_library(t["p"], t["anchor"], t["kept"], t["launched"], t["positions"], t["values"]),
                 lambda t: compiled["jump"](t["p"], t["anchor"], t["kept"], t["launched"], t["positions"],
                                            t["values"])),
        "landing": (lambda t: landing_library(t["anchor"], t["mean"], t["p"], t["launched"]),
                    lambda t: compiled["landing"](t["anchor"], t["mean"], t["p"], t["launched"])),
    }
    start = time.perf_counter()
    for _, fused in cases.values():
        for t in tensors:
            fused(t)
    compile_s = time.perf_counter() - start
    print(f"{args.preset}: {len(shapes)} tensors, {sum(a * b for a, b in shapes):,} values, chunks {h} x {w}, "
          f"top-{args.topk} (groups of {g})")
    print("| passes | library (torch ops) ms | compiled ms |\n|---|---|---|")
    for name, (library, fused) in cases.items():
        ms = [1e3 * median_seconds(lambda f=f: [f(t) for t in tensors], args.repeats) for f in (library, fused)]
        print(f"| {name} | {ms[0]:.2f} | {ms[1]:.2f} |")
    print(f"compile, once per shape: {compile_s:.1f} s")


if __name__ == "__main__":
    main()
