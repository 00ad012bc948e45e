"""Each optimizer's step against torch AdamW (foreach and fused) on one device (a GPU where
there is one): milliseconds per step, and the kernel launches, host synchronisations and
copies the profiler sees in one step (a periodic method's whole cycle, shown per step).

    python benchmarks/gpu_step.py [--sizes gpt2-small,1.3b] [--dtype fp32|bf16]
        [--optimizers demo,...] [--steps 10] [--device cuda] [--json out.json]

One process, a world of one (NCCL on CUDA, gloo on CPU), parameters of GPT-2's shapes (small:
12 x 768, vocab 50257, 124M; 1.3b: 24 x 2048, context 2048, 1.3B) with random gradients (two
sets made on the device once, taken in turn by assignment: no copy inside a timed step). Only `step()` is
timed, the device synchronised before and after each. Every optimizer takes warm-up steps
into its steady state (a periodic method twice round its cycle), then `--steps` steps (a
periodic method: whole cycles, at least one) are timed; its costliest step (the sync) is
reported apart. Then one more cycle runs under torch.profiler, which counts
`cudaLaunchKernel`-like calls (launches), `cuda*Synchronize` and blocking `cudaMemcpy` calls
(host syncs) and `cudaMemcpyAsync` (copies). A world of one decodes one message per step; W
ranks decode W (a DeMo or SparseLoCo step's decode grows with W, the rest does not).
--dtype: the parameters' and gradients' dtype (fp32 by default: the master weights of bf16
autocast training; bf16 for pure-bf16 training).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from step_configs import CONFIGS, gpt2_shapes

SIZES = {"gpt2-small": dict(blocks=12, width=768, vocab=50257, context=1024),
         "1.3b": dict(blocks=24, width=2048, vocab=50257, context=2048),
         "tiny": dict(blocks=2, width=64, vocab=512, context=64)}     # a quick check on CPU
LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")   # the host waits
# (cudaStreamWaitEvent is not here: one stream waiting for another keeps the host free)
COPY = ("cudaMemcpyAsync",)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gradient_pool(params, device, sets: int = 2) -> list[list[torch.Tensor]]:
    """`sets` sets of random gradients made on the device once; steps take them in turn, by
    assignment (no copy kernel inside a timed or profiled step, no host RNG at 1.3B)."""
    gen = torch.Generator(device).manual_seed(0)
    return [[torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 1e-3 for p in params]
            for _ in range(sets)]


def _take(params, pool, step: int) -> None:
    for p, g in zip(params, pool[step % len(pool)]):
        p.grad = g


def timed_steps(opt, params, pool, device, first: int, count: int) -> list[float]:
    """Seconds of each of `count` steps from step `first`."""
    times = []
    for step in range(first, first + count):
        _take(params, pool, step)
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def profiled_cycle(opt, params, pool, device, first: int, period: int) -> dict:
    """Launches, host syncs and copies per step over one cycle, from the profiler's CPU-side events."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        for step in range(first, first + period):
            _take(params, pool, step)
            opt.step()
        _sync(device)
    counts = _counted(prof)
    idle = _idle_counts(device, activities)                 # what the profiler and the final synchronize add
    return {k: max(0, v - idle[k]) / period for k, v in counts.items()}


def _counted(prof) -> dict:
    counts = {"launches": 0, "syncs": 0, "copies": 0}
    for event in prof.key_averages():
        for kind, names in (("launches", LAUNCH), ("syncs", SYNC), ("copies", COPY)):
            if event.key in names:
                counts[kind] += event.count
    return counts


def _idle_counts(device, activities) -> dict:
    """The counts of a profile with nothing in it but the final synchronize."""
    from torch.profiler import profile
    with profile(activities=activities) as prof:
        _sync(device)
    return _counted(prof)


def run_one(name: str, params, pool, device, steps: int) -> dict:
    config = CONFIGS[name]
    opt = config.build(params, None)
    period = config.period
    warmup = max(8, 2 * period)
    timed_steps(opt, params, pool, device, 0, warmup)
    cycles = max(1, -(-steps // period))
    times = timed_steps(opt, params, pool, device, warmup, cycles * period)
    profile = profiled_cycle(opt, params, pool, device, warmup + cycles * period, period)
    if hasattr(opt, "flush"):
        opt.flush()
    per_position = [statistics.median(times[i::period]) for i in range(period)]
    del opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"mean_ms": 1e3 * sum(per_position) / period, "max_ms": 1e3 * max(per_position), **profile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="gpt2-small,1.3b", help="from: " + ", ".join(SIZES))
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--optimizers", default=",".join(CONFIGS), help="from: " + ", ".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())     # NCCL's device_id needs the index
    names = args.optimizers.split(",")
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, {args.dtype} parameters, world 1", flush=True)
    results = {}
    for size in args.sizes.split(","):
        params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02)
                  for s in gpt2_shapes(**SIZES[size])]
        pool = gradient_pool(params, device)
        n = sum(p.numel() for p in params)
        print(f"\n{size}: {len(params)} tensors, {n / 1e6:.1f}M parameters\n", flush=True)
        print("| optimizer | ms / step (mean) | costliest step | / AdamW foreach | / fused | launches / step | "
              "host syncs / step | copies / step |")
        print("|---|---|---|---|---|---|---|---|")
        rows = results[size] = {}
        for name in names:
            try:
                rows[name] = run_one(name, params, pool, device, args.steps)
            except Exception as err:                    # one optimizer failing keeps the rest of the table
                traceback.print_exc()
                print(f"| {name} | failed: {type(err).__name__}: {str(err)[:200]} |", flush=True)
                continue
            r = rows[name]
            foreach = rows.get("torch-adamw-foreach", {}).get("mean_ms")
            fused = rows.get("torch-adamw-fused", {}).get("mean_ms")
            ratio = lambda b: f"{r['mean_ms'] / b:.2f}x" if b else "-"
            print(f"| {name} | {r['mean_ms']:.2f} | {r['max_ms']:.2f} | {ratio(foreach)} | {ratio(fused)} | "
                  f"{r['launches']:,.0f} | {r['syncs']:.1f} | {r['copies']:.1f} |", flush=True)
        del params, pool
        gc.collect()
        if args.json:                                    # after every size: a cut-off run keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
