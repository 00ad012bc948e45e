"""What SparseLoCo's sync costs in compute, against its local steps and a plain AdamW step.

    python benchmarks/sparseloco_sync.py [--preset wan] [--sync-every 8] [--delay 6] [--rounds 12]
                                         [--topk 128] [--chunk 64] [--indices packed]

Two ranks on a real gloo group (one process each, one torch thread each, as the harness runs
`wan` on 2 cores), the preset's model with random gradients, no link: every step of a round is
timed on rank 0 and the table gives, per step of the round (median over rounds), its time and
what it adds to a local step: the sync step (the local step, then the encode: Δ, e, top-k, the
2-bit values, e', the eager jump and θ_s) and the landing step (the other ranks' bytes read,
the mean, θ₀, e and the rejoin). The last lines amortise them over the round, beside torch
AdamW's step on the same parameters (the dense baseline's optimizer step, whose gradient
all-reduce is not in it). A second table times the compressor's parts on the model's shapes in
one process, alternating: the encode and the landing's mean tensor by tensor (`SparseLoCoTopK`)
against `FlatSparseLoCo`, the path the optimizer takes.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from thinwire import SparseLoCo
from thinwire.train.config import get_preset
from thinwire.train.model import build_model


def _adamw(params):
    return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _timed_steps(opt, params, rounds: int, every: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(p.shape, generator=gen) * 1e-3 for p in params] for _ in range(every)]
    times = []
    for step in range(1, every * (rounds + 2) + 1):
        for p, g in zip(params, grads[step % every]):
            p.grad = g
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[2 * every:]                                   # two rounds of warm-up dropped


def _worker(rank: int, args, port: int, out) -> None:
    join_gloo(rank, port)
    cfg = get_preset(args.preset)
    params = list(build_model(cfg).parameters())
    opt = SparseLoCo(params, inner=_adamw, sync_every=args.sync_every, overlap=True, delay=args.delay,
                     topk=args.topk, chunk=args.chunk, indices=args.indices)
    sparse = _timed_steps(opt, params, args.rounds, args.sync_every, rank)
    adamw_params = list(build_model(cfg).parameters())
    dense = _timed_steps(_adamw(adamw_params), adamw_params, args.rounds, args.sync_every, rank)
    if rank == 0:
        out.put((sparse, dense))
    dist.destroy_process_group()


def join_gloo(rank: int, port: int) -> None:
    """This worker: one torch thread, rank `rank` of a 2-rank gloo group on localhost:`port`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)


def on_two_ranks(worker, args):
    """worker(rank, args, port, out) in 2 spawned processes; what rank 0 put on `out`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, port, out), nprocs=2)
    return out.get()


def round_arguments(parser: argparse.ArgumentParser, topk: int, chunk: int) -> None:
    """The options of both SparseLoCo benchmarks: the preset, H, τ and the compression."""
    parser.add_argument("--preset", default="wan")
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--delay", type=int, default=6)
    parser.add_argument("--topk", type=int, default=topk, help=f"values kept per chunk (default {topk})")
    parser.add_argument("--chunk", type=int, default=chunk, help=f"target chunk side (default {chunk})")
    parser.add_argument("--indices", default="packed", help="coding of the kept indices: packed (default) | elias-fano")


def round_table(sparse: list[float], dense: list[float], every: int, delay: int) -> None:
    by_step = [statistics.median(sparse[i::every]) for i in range(every)]   # index 0: step 1 of a round
    sync, landing = every - 1, (every - 1 + delay) % every                  # the round's last step syncs
    local = statistics.median(t for i, t in enumerate(by_step) if i not in (sync, landing))
    print(f"| step of the round | ms | over a local step |\n|---|---|---|")
    for i, t in enumerate(by_step):
        what = "sync (encode)" if i == sync else "landing" if i == landing else "local"
        if sync == landing and i == sync:
            what = "landing + sync"
        print(f"| {i + 1} ({what}) | {1e3 * t:.1f} | {1e3 * (t - local):+.1f} |")
    extra = sum(by_step) - every * local
    adamw = statistics.median(dense)
    print(f"| local step, median | {1e3 * local:.1f} | |")
    print(f"| torch AdamW step | {1e3 * adamw:.1f} | {1e3 * (adamw - local):+.1f} |")
    print(f"| sync + landing, per round | {1e3 * extra:.1f} | {1e3 * extra / every:.2f} ms per step amortised |")


def parts_table(args) -> None:
    """The sync's compressor work over the model's tensors, one thread, alternating: tensor by
    tensor through SparseLoCoTopK (encode_sent; read and aggregate of 2 rows), against
    FlatSparseLoCo (encode of each, one write; one decode, then each tensor's mean), the path
    SparseLoCo takes, with the indices packed and Elias-Fano coded."""
    from thinwire.compress import Payload, SparseLoCoTopK
    torch.set_num_threads(1)
    comp = SparseLoCoTopK(args.topk, args.chunk)
    xs = [torch.randn(p.shape) * 1e-3 for p in build_model(get_preset(args.preset)).parameters()]
    flat, payload, own, rows = _flat_sync(comp, xs)
    ef = _flat_sync(SparseLoCoTopK(args.topk, args.chunk, indices="elias-fano"), xs)
    means = [torch.empty_like(x) for x in xs]

    def per_tensor_landing():
        for x, span in zip(xs, flat.payloads):
            spec = comp.payload_spec(x.shape)
            comp.aggregate([comp.read(Payload.from_buffer(span.of(row), spec), x.shape) for row in rows], x.shape)

    def flat_landing(flat, payload, own, rows):
        decoded = flat.decode(rows, (0, own))
        for i, out in enumerate(means):
            flat.mean(i, decoded, rows, 0, "mean", out)

    def flat_encode(flat, payload, own, rows):
        [flat.encode(i, x, payload) for i, x in enumerate(xs)]
        flat.write(payload)

    parts = {
        "encode, tensor by tensor (`SparseLoCoTopK.encode_sent`)":
            lambda: [comp.encode_sent(x, span.of(payload)) for x, span in zip(xs, flat.payloads)],
        "encode, `FlatSparseLoCo` (each tensor, then the groups' bytes)": lambda: flat_encode(flat, payload, own, rows),
        "encode, `FlatSparseLoCo`, indices Elias-Fano coded": lambda: flat_encode(*ef),
        "landing's mean of 2 rows, tensor by tensor (read, aggregate)": per_tensor_landing,
        "landing's mean of 2 rows, `FlatSparseLoCo` (decode, each mean)": lambda: flat_landing(flat, payload, own, rows),
        "landing's mean of 2 rows, `FlatSparseLoCo`, indices Elias-Fano coded": lambda: flat_landing(*ef),
    }
    times = {name: [] for name in parts}
    for _ in range(args.rounds + 2):
        for name, fn in parts.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print("\n| compressor work of a sync, all parameters, one thread (alternating, medians) | ms |\n|---|---|")
    for name, t in times.items():
        print(f"| {name} | {1e3 * statistics.median(t[2:]):.1f} |")


def _flat_sync(comp, xs):
    """FlatSparseLoCo over xs' shapes, one sync encoded: (it, its payload, its own rows, 2 rows)."""
    from thinwire.compress.sparseloco_flat import FlatSparseLoCo
    flat = FlatSparseLoCo(comp, [x.shape for x in xs], "cpu")
    payload = torch.empty(flat.nbytes, dtype=torch.uint8)
    own = {i: flat.encode(i, x, payload) for i, x in enumerate(xs)}
    flat.write(payload)
    return flat, payload, own, [payload.clone(), payload.clone()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    round_arguments(parser, topk=128, chunk=64)                   # the paper's
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    sparse, dense = on_two_ranks(_worker, args)
    n = sum(p.numel() for p in build_model(get_preset(args.preset)).parameters())
    print(f"SparseLoCo on `{args.preset}` ({n / 1e6:.2f}M parameters), 2 ranks on gloo, H {args.sync_every}, "
          f"delay {args.delay}, eager, top-{args.topk} of {args.chunk} x {args.chunk}; {args.rounds} rounds after 2 of warm-up, rank 0's steps\n")
    round_table(sparse, dense, args.sync_every, args.delay)
    parts_table(args)


if __name__ == "__main__":
    main()
