"""Where one optimizer step's time goes on a GPU: for each step of one cycle (a periodic
method's H steps), the wall-clock milliseconds, and the kernels that took the most device
time and the ops that took the most host time, from torch.profiler.

    python benchmarks/gpu_kernels.py [--size gpt2-small] [--dtype fp32|bf16]
        [--optimizers demo,sparseloco-fused] [--top 12] [--device cuda]

Same parameters, gradients and warm-up as benchmarks/gpu_step.py (a world of one). Use it
to find the step that costs most and the kernel that makes it cost; gpu_step.py gives the
table to compare optimizers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from gpu_step import SIZES, _sync, _take, gradient_pool
from step_configs import CONFIGS, gpt2_shapes


def device_time(event) -> float:
    """Microseconds `event` (a key_averages row) spent on the device, across torch versions."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return getattr(event, attr)
    return 0.0


def profile_step(opt, params, pool, device, step: int, top: int) -> None:
    """One step under the profiler: its wall time, top kernels by device time, top ops by host time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _take(params, pool, step)
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        opt.step()
        _sync(device)
    wall = 1e3 * (time.perf_counter() - start)
    rows = prof.key_averages()
    on_device = [e for e in rows if e.self_cpu_time_total == 0 and device_time(e) > 0]   # kernels, copies
    kernels = sorted(on_device, key=device_time, reverse=True)[:top]
    busy = sum(device_time(e) for e in on_device)
    print(f"\n  step {step}: {wall:.2f} ms wall (profiled), device kernels {busy / 1e3:.2f} ms")
    for e in kernels:
        print(f"    {device_time(e) / 1e3:8.3f} ms  x{e.count:<5} {e.key[:110]}")
    host = sorted(rows, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    print("    host:", ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.2f} ms x{e.count}" for e in host))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="gpt2-small", choices=sorted(SIZES))
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--optimizers", default="demo,sparseloco-fused", help="from: " + ", ".join(CONFIGS))
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02)
              for s in gpt2_shapes(**SIZES[args.size])]
    pool = gradient_pool(params, device)
    for name in args.optimizers.split(","):
        config = CONFIGS[name]
        opt = config.build(params, None)
        warmup = max(8, 2 * config.period)
        for step in range(warmup):
            _take(params, pool, step)
            opt.step()
        print(f"\n{name}, {args.size}, {args.dtype}: one cycle of {config.period} step(s)", flush=True)
        for step in range(warmup, warmup + config.period):
            profile_step(opt, params, pool, device, step, args.top)
        if hasattr(opt, "flush"):
            opt.flush()
        del opt
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
