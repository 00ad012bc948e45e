"""APMSqueeze: bytes on the wire, compute of the compressed all-reduce, and convergence
against dense Adam. Prints markdown tables.

    python benchmarks/apmsqueeze_bench.py bytes    [--warmup-frac 0.2]
    python benchmarks/apmsqueeze_bench.py time     [--numel 10000000] [--world 4] [--repeats 5]
    python benchmarks/apmsqueeze_bench.py converge [--workers 4] [--steps 300] [--warmup-frac 0.2]

bytes: per rank and step from the wire format (the formulas the tests check against the
communicator's counts): phase 1 all_to_all of W chunks of H + 4 + N/(8W) bytes, H = 8 +
ceil(P/8) the message prefix (header and presence bitmap of the P parameters), of which the
W−1 bound for peers are handed over, phase 2 all_gather 4 + N/(8W), N = parameters padded
to a multiple of 8W; dense (and the warmup): one all-reduce of 4 (n + 17 + P) bytes in fp32
(the gradients and the float trailer, thinwire.optim.protocol.trailer_numel).
"payload" is what the communicator counts as this rank's message (both phases); "link" is
what a rank sends under ring / pairwise algorithms (comm/links.py), the fair comparison
with a ring all-reduce, which itself moves 2n(W−1)/W per rank.
time: one rank's compute in the compressed all-reduce, with a loopback communicator that
hands back this rank's own buffers in the shapes W ranks would (no transfer: compute only),
against torch.optim.Adam(foreach=True).step() on the same number of parameters.
converge: real gloo workers train the quickrun byte-level model (thinwire.train.quickrun)
with dense Adam (DenseAllReduce, fp32) and APMSqueeze at the same lr, APMSqueeze's warmup
round(warmup-frac × steps) but at least MIN_WARMUP_STEPS (5; fewer are refused); final
validation loss and the bytes each rank's communicator counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from shapes import MODELS

from thinwire import DenseAllReduce
from thinwire.comm import CommStats
from thinwire.comm.collectives import compressed_allreduce, padded_numel
from thinwire.comm.communicator import Pending
from thinwire.optim.apmsqueeze import MIN_WARMUP_STEPS, APMSqueeze
from thinwire.optim.protocol import prefix_nbytes, trailer_numel
from thinwire.train import quickrun
from thinwire.train.launch import launch


def step_bytes(numel: int, world: int, n_params: int) -> dict:
    n = padded_numel(numel, world)
    c = n // world
    chunk1, p2 = prefix_nbytes(n_params) + 4 + c // 8, 4 + c // 8     # a phase-1 chunk, phase 2
    dense = 4 * (numel + trailer_numel(n_params))
    return {"payload": chunk1 * (world - 1) + p2, "link": chunk1 * (world - 1) + p2 * (world - 1),
            "fp32": dense, "fp32_link": 2 * dense * (world - 1) // world}


def bytes_table(warmup_frac: float) -> None:
    print(f"Per rank. Whole run: {warmup_frac:.0%} of steps dense fp32 warmup, the rest compressed.\n")
    print("| model | W | 1-bit payload/step | vs fp32 | vs bf16 | 1-bit link/step | link vs fp32 ring | "
          "whole run vs fp32 (payload) | whole run vs fp32 (link) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shapes in MODELS.items():
        sizes = [torch.Size(s).numel() for s in shapes()]
        numel = sum(sizes)
        for world in (2, 4, 8, 16):
            b = step_bytes(numel, world, len(sizes))
            run_payload = warmup_frac * b["fp32"] + (1 - warmup_frac) * b["payload"]
            run_link = warmup_frac * b["fp32_link"] + (1 - warmup_frac) * b["link"]
            print(f"| {name} ({numel / 1e6:.0f}M) | {world} | {b['payload'] / 1e6:.2f} MB | "
                  f"{b['fp32'] / b['payload']:.1f}x | {b['fp32'] / 2 / b['payload']:.1f}x | {b['link'] / 1e6:.2f} MB | "
                  f"{b['fp32_link'] / b['link']:.1f}x | {b['fp32'] / run_payload:.2f}x | "
                  f"{b['fp32_link'] / run_link:.2f}x |")


class Loopback:
    """A stand-in for W ranks' collectives on one process: this rank's own buffers come back in
    the shapes W ranks would send (same compute, no transfer). Benchmark use only."""

    def __init__(self, world: int):
        self.world_size, self.rank, self.stats = world, 0, CommStats()

    def all_to_all(self, buf, tag="payload", send_own=True, async_op=False):
        out = buf.view(self.world_size, -1).clone()
        return Pending(None, out) if async_op else out

    def all_gather(self, buf, tag="payload", async_op=False):
        out = buf[None].expand(self.world_size, -1).clone()
        return Pending(None, out) if async_op else out


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_table(numel: int, world: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    n = padded_numel(numel, world)
    x, we, se = (torch.randn(k, generator=gen) for k in (n, n, n // world))
    comm, workspace, out = Loopback(world), {}, torch.empty(n)
    allreduce = median_seconds(lambda: compressed_allreduce(comm, x, we, se, workspace=workspace, out=out), repeats)
    p = torch.nn.Parameter(torch.randn(numel, generator=gen))
    p.grad = torch.randn(numel, generator=gen)
    adam = torch.optim.Adam([p], lr=1e-3, foreach=True)
    adam_s = median_seconds(adam.step, repeats)
    opt = APMSqueeze([p], lr=1e-3, warmup_steps=MIN_WARMUP_STEPS)    # world of one
    for _ in range(MIN_WARMUP_STEPS - 1):               # the warmup: these and median_seconds' untimed first call
        opt.step()
    apms = median_seconds(opt.step, repeats)            # then compressed steps
    print(f"{numel / 1e6:.0f}M elements, threads={torch.get_num_threads()}, median of {repeats}\n")
    print("| what | s | vs Adam step |")
    print("|---|---|---|")
    print(f"| torch.optim.Adam(foreach=True).step() | {adam_s:.4f} | 1.00 |")
    print(f"| compressed all-reduce compute, one rank of W={world} | {allreduce:.4f} | {allreduce / adam_s:.2f} |")
    print(f"| APMSqueeze compressed step, W=1 (all-reduce + momentum + update) | {apms:.4f} | {apms / adam_s:.2f} |")


def _val_loss(model, data) -> float:
    gen = torch.Generator().manual_seed(10**6)
    starts = torch.randint(data.numel() * 9 // 10, data.numel() - quickrun.CONTEXT - 1, (2048,), generator=gen)
    windows = data[starts[:, None] + torch.arange(quickrun.CONTEXT + 1)]
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(windows[:, :-1]), windows[:, -1]))


def _train(rank, world, kind, steps, warmup, lr, rows, out):
    data = quickrun.stdlib_bytes()
    train = data[: data.numel() * 9 // 10]                 # the last 10 % is validation
    model = quickrun.make_model()
    opt = (DenseAllReduce(torch.optim.Adam(model.parameters(), lr=lr)) if kind == "dense Adam (fp32)"
           else APMSqueeze(model.parameters(), lr=lr, warmup_steps=warmup))
    for step in range(steps):
        x, y = quickrun.batch(train, step, rank, world, rows)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        s = opt.comm_stats.by_tag["payload"]
        torch.save({"val": _val_loss(model, data), "payload": s.payload_bytes, "link": s.link_bytes_sent,
                    "numel": sum(p.numel() for p in model.parameters())}, out)


def converge_table(workers: int, steps: int, warmup_frac: float, lr: float, rows: int) -> None:
    warmup = round(warmup_frac * steps)
    if warmup < MIN_WARMUP_STEPS:                         # APMSqueeze refuses fewer (its 1-bit steps would diverge)
        print(f"--warmup-frac {warmup_frac} of {steps} steps gives {warmup} warmup step(s); APMSqueeze needs at "
              f"least {MIN_WARMUP_STEPS}, so T_w = {MIN_WARMUP_STEPS}\n")
        warmup = MIN_WARMUP_STEPS
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense Adam (fp32)", f"APMSqueeze T_w={warmup}"):
            out = os.path.join(tmp, "result.pt")
            launch(_train, workers, args=(kind, steps, warmup, lr, rows, out))
            results[kind] = torch.load(out)
    dense = results["dense Adam (fp32)"]
    print(f"quickrun byte model ({dense['numel']:,} params), {workers} gloo workers, {steps} steps, lr {lr}, "
          f"global batch {rows}\n")
    print("| optimizer | final val loss | vs dense | payload bytes/rank | vs dense | link bytes sent/rank | vs dense |")
    print("|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        print(f"| {kind} | {r['val']:.4f} | {r['val'] / dense['val'] - 1:+.2%} | {r['payload']:,} | "
              f"{dense['payload'] / r['payload']:.2f}x | {r['link']:,} | {dense['link'] / max(r['link'], 1):.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("bytes", "time", "converge"))
    parser.add_argument("--warmup-frac", type=float, default=0.2)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    if args.what == "bytes":
        bytes_table(args.warmup_frac)
    elif args.what == "time":
        time_table(args.numel, args.world, args.repeats)
    else:
        converge_table(args.workers, args.steps, args.warmup_frac, args.lr, args.rows)


if __name__ == "__main__":
    main()
