"""The chunked compressors' two heavy kernels on a GPU, variant by variant: selecting the k
largest of each 4,096-value chunk, and the chunk transform (DCT) that comes before it.

    python benchmarks/gpu_topk.py [--params 124e6,1.3e9] [--k 32,64] [--reps 20] [--parts select,transform]

Selection, on [rows, 4096] float32 magnitudes (rows = params / 4096):
  topk-float   torch.topk(sorted=False), what the CUDA path ran before
  topk-int32   the same on the int32 view (non-negative float32 orders as its bits)
  two-level    ops.select._two_level on the int32 view, at four group sizes g
  triton       ops.select_triton.row_largest at 1 to 16 warps a row: one read (ascending)
  topk+sort    topk-float then the ascending sort Elias-Fano coding needs (triton's is free)
Transform, on an image [rows · 64, 64 · cols] float32, 64 × 64 chunks (P X Pᵀ per chunk):
  mm+bmm fp32 / tf32 / bf16  the grouped path's two GEMMs at each matmul precision
  fused fp32 / tf32          a Triton prototype: one program per chunk, P X Pᵀ in registers,
                             then the top-k of |·| in the same program (no coefficient image)
Each variant is checked against the float path (the same k-th largest value in every row;
transform error against float64) and timed with CUDA events (median of --reps after
warm-up). Memory floor: the bytes a variant must move over the copy rate measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from thinwire.ops import dct_matrix                    # noqa: E402
from thinwire.ops.select import _group_size, _two_level   # noqa: E402

CHUNK = 64


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps runs, after three warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_rate(device) -> float:
    """Bytes per ms of a large device-to-device copy (read + write)."""
    src = torch.empty(2 ** 28, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / ms


def kth_values(mag: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The smallest picked value of each row: equal to topk's k-th when the set is right."""
    return mag.gather(-1, idx).amin(dim=-1)


def selection_variants(k: int):
    from thinwire.ops import select_triton as st

    def two_level(g):
        return lambda m: _two_level(m.view(torch.int32), k, g)
    variants = {
        "topk-float": lambda m: m.topk(k, dim=-1, sorted=False).indices,
        "topk-int32": lambda m: m.view(torch.int32).topk(k, dim=-1, sorted=False).indices,
        "topk+sort": lambda m: m.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values,
    }
    default = _group_size(CHUNK * CHUNK, k)
    for g in sorted({default // 2, default, 2 * default, 4 * default}):
        variants[f"two-level g {g}" + (" (default)" if g == default else "")] = two_level(g)
    for warps in (1, 2, 4, 8, 16):
        variants[f"triton {warps} warps"] = (lambda w: lambda m: st.row_largest(m, k, w))(warps)
    return variants


def bench_selection(rows: int, k: int, reps: int, rate: float, device) -> None:
    mag = torch.randn(rows, CHUNK * CHUNK, device=device).abs_()
    want = mag.topk(k, dim=-1).values[:, -1]
    floor = rows * CHUNK * CHUNK * 4 / rate
    for name, fn in selection_variants(k).items():
        try:
            ok = torch.equal(kth_values(mag, fn(mag)), want)
            ms = timed(lambda: fn(mag), reps)
            print(f"| select | {rows:,} x 4096, k {k} | {name} | {ms:.3f} | {floor:.3f} | {'yes' if ok else 'NO'} |")
        except Exception as exc:                                       # report and go on: one call per lease
            print(f"| select | {rows:,} x 4096, k {k} | {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | |")


def gemm_transform(x: torch.Tensor, p: torch.Tensor, dtype) -> torch.Tensor:
    """P X Pᵀ per 64 × 64 chunk of x [R, C] as the grouped path runs it: one mm, one bmm."""
    r, c = x.shape
    xs, ps = x.to(dtype), p.to(dtype)
    t = torch.mm(xs.view(-1, CHUNK), ps.T)                           # X Pᵀ: [R·C/64, 64]
    return torch.bmm(ps.expand(r // CHUNK, CHUNK, CHUNK), t.view(r // CHUNK, CHUNK, c))   # [R/64, 64, C]


def bench_transform(rows: int, k: int, reps: int, rate: float, device) -> None:
    cols = 768
    image = torch.randn(rows * CHUNK * CHUNK // cols, cols, device=device)
    p = dct_matrix(CHUNK, device=device)
    part = image[: 8 * cols]                                          # the checks' slice: [8 · 768, 768]
    ref = gemm_transform(part.double(), p.double(), torch.float64)
    floor = 2 * image.numel() * 4 / rate
    for name, dtype, tf32 in (("mm+bmm fp32", torch.float32, False), ("mm+bmm tf32", torch.float32, True),
                              ("mm+bmm bf16", torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        out = gemm_transform(part, p, dtype)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ms = timed(lambda: gemm_transform(image, p, dtype), reps)
        print(f"| transform | {image.numel():,} | {name} | {ms:.3f} | {floor:.3f} | rel err {err:.1e} |")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        from fused_dct_select import fused_dct_select
        # [R/64, 64, C] -> [R/64, 64, C/64, 64] -> [R/64, C/64, 64, 64]: chunk-major, as the kernel reads chunks
        mag = ref.view(-1, CHUNK, cols // CHUNK, CHUNK).permute(0, 2, 1, 3).abs()
        want = mag.reshape(-1, CHUNK * CHUNK).float().topk(k, dim=-1).values[:, -1]
        for prec in ("ieee", "tf32"):
            idx, vals = fused_dct_select(part, p, k, prec)
            close = ((vals.abs().amin(-1) - want).abs() <= 1e-4 * want.abs().clamp_min(1e-6)).float().mean().item()
            ms = timed(lambda: fused_dct_select(image, p, k, prec), reps)
            print(f"| transform+select | {image.numel():,}, k {k} | fused {prec} | {ms:.3f} | {floor / 2:.3f} | "
                  f"k-th value within 1e-4 in {100 * close:.2f} % of chunks |")
    except Exception as exc:
        print(f"| transform+select | | fused | failed: {type(exc).__name__}: {str(exc)[:160]} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="124e6,1.3e9")
    parser.add_argument("--k", default="32,64")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--parts", default="select,transform")
    args = parser.parse_args()
    device = torch.device("cuda")
    rate = copy_rate(device)
    print(f"{torch.cuda.get_device_name()}: copy {rate / 1e9:.2f} TB/s (read + write)\n")
    print("| kernel | size | variant | ms (median) | memory floor ms | check |\n|---|---|---|---|---|---|")
    for params in (float(p) for p in args.params.split(",")):
        rows = int(params) // (CHUNK * CHUNK) // 12 * 12           # whole 768-column row blocks
        for k in (int(v) for v in args.k.split(",")) if "select" in args.parts else ():
            bench_selection(rows, k, args.reps, rate, device)
        if "transform" in args.parts:
            bench_transform(rows, int(args.k.split(",")[0]), args.reps, rate, device)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
