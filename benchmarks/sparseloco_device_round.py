"""SparseLoCo's round against torch AdamW's steps on one device (a GPU where there is one).

    python benchmarks/sparseloco_device_round.py [--n-layer 12] [--n-embd 768] [--context 1024]
        [--batch 8] [--vocab 50304] [--sync-every 5] [--delay 4] [--topk 32] [--chunk 32]
        [--indices elias-fano] [--bf16] [--blocks 10] [--device cuda]

One process, a world of one (NCCL on CUDA, gloo on CPU), the harness's GPT at the given shape
(GPT-2 small by default: 12 layers, width 768, 1024 tokens; 124M parameters). It alternates
blocks of `sync-every` training steps (forward, backward, step; the device synchronised at
each step's end) of:
- torch AdamW with torch's default implementation on that device (foreach on CUDA), and with
  `fused=True`;
- SparseLoCo (overlap, delay, eager; the same AdamW inside, default implementation).
With one rank the landing decodes no other rank's row, so the table adds, apart, the decode and
mean of a second row of the same message (grouped: `GroupedSparseLoCo.read` and one index_add_
per row; `--per-tensor`: `FlatSparseLoCo.decode` / `mean`), which a second rank would cost. It first encodes the same tensors on CPU and twice on the device
(`FlatSparseLoCo`, as SparseLoCo's sync does) and reports which tensors' bytes differ, whether
only by a swap of equal magnitudes in the kept positions (top-k's tie-break), how far the decoded
values are apart, and whether the device repeats its own bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device, fn) -> float:
    """Seconds `fn()` takes, the device idle before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _train_step(model, opt, x, y, bf16: bool) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(x)
    F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def check_bytes(model, args, device) -> str:
    """The compressor on `device` against CPU, on the model's shapes (random tensors): which
    tensors' bytes differ, whether their kept positions do, and the largest difference of a
    decoded value (the 2-bit levels are float64 statistics, reduced in another order on a GPU)."""
    from thinwire.compress import SparseLoCoTopK
    from thinwire.compress.sparseloco_flat import FlatSparseLoCo
    comp = SparseLoCoTopK(args.topk, args.chunk, indices=args.indices)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(p.shape, generator=gen) * 1e-3 for p in model.parameters()]
    out = []
    for where in ("cpu", device, device):                  # the device twice: its bytes must repeat
        flat = FlatSparseLoCo(comp, [x.shape for x in xs], where)
        payload = torch.empty(flat.nbytes, dtype=torch.uint8, device=where)
        for i, x in enumerate(xs):
            flat.stage(i, x.to(where))
        flat.select()
        for i, x in enumerate(xs):
            flat.encode(i, x.to(where), payload)
        flat.write(payload)
        decoded = flat.decode([payload])[0]
        out.append((flat, payload.cpu(), {i: (p.cpu(), v.cpu()) for i, (p, v) in decoded.items()}))
    (flat, a, da), (_, b, db), (_, again, _) = out
    differ = [i for i, span in enumerate(flat.payloads) if not torch.equal(span.of(a), span.of(b))]
    moved = [i for i in da if not torch.equal(da[i][0].sort().values, db[i][0].sort().values)]
    ties = all(_swapped_ties(xs[i].view(-1), da[i][0], db[i][0]) for i in moved)
    gap = max((float((da[i][1] - db[i][1]).abs().max() / da[i][1].abs().max()) for i in da if i not in moved),
              default=0.0)                                 # every tensor's kept positions moved: none to compare
    return (f"{device} against CPU: {len(differ)} of {len(xs)} tensors' bytes differ, {len(moved)} in their kept "
            f"positions{' (only between equal magnitudes)' if ties else ' (NOT ONLY TIES)'}; decoded values "
            f"within {gap:.2g} of the largest (relative); a second encode on {device}: "
            f"{'the same bytes' if torch.equal(b, again) else 'OTHER BYTES'}")


def _swapped_ties(x: torch.Tensor, kept: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two top-k selections of x differ only by swapping elements of equal |x|."""
    mine, theirs = set(kept.tolist()), set(other.tolist())
    only_mine = torch.tensor(sorted(mine - theirs), dtype=torch.long)
    only_theirs = torch.tensor(sorted(theirs - mine), dtype=torch.long)
    a, b = x[only_mine].abs().sort().values, x[only_theirs].abs().sort().values
    return a.numel() == b.numel() and torch.equal(a, b)


def second_row_landing(model, device, sl, payload) -> float:
    """Seconds to decode and average one more rank's row of the message on `device` (median of 5):
    the landing of two rows (the same bytes as the other's) against one; grouped (every row
    read at once, one index_add_ per row) or per tensor (this rank's own as its encode left it)."""
    means = [torch.empty(p.shape, device=device) for p in model.parameters()]
    flat, own = sl.sync._flat, sl.sync._own_sent
    mean = torch.empty(sum(p.numel() for p in model.parameters()), device=device)

    def landing(rows):
        if sl.grouped:
            positions, values, _ = sl.sync._grouped.read(torch.stack(rows))
            mean.zero_()
            for r in range(len(rows)):
                mean.index_add_(0, positions[r], values[r])
            return
        decoded = flat.decode(rows, (0, own))
        for i, out in enumerate(means):
            flat.mean(i, decoded, rows, 0, "mean", out)
    two = [_timed(device, lambda: landing([payload, payload])) for _ in range(6)][1:]
    one = [_timed(device, lambda: landing([payload])) for _ in range(6)][1:]
    return statistics.median(two) - statistics.median(one)


def main() -> None:
    from thinwire import SparseLoCo
    from thinwire.train.config import get_preset
    from thinwire.train.model import build_model
    from thinwire.train.probe import step_times
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("n-layer", 12), ("n-embd", 768), ("context", 1024), ("batch", 8), ("vocab", 50304),
                          ("sync-every", 5), ("delay", 4), ("topk", 32), ("chunk", 32), ("blocks", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--indices", default="elias-fano")
    parser.add_argument("--bf16", action="store_true", help="forward under bf16 autocast")
    parser.add_argument("--per-tensor", action="store_true", help="SparseLoCo's per-tensor sync (grouped = False)")
    parser.add_argument("--profile", action="store_true", help="then profile one round of SparseLoCo's steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)
    cfg = get_preset("wan", n_layer=args.n_layer, n_embd=args.n_embd, n_head=max(1, args.n_embd // 64),
                     context=args.context, vocab_size=args.vocab)
    models = {name: build_model(cfg).to(device) for name in ("adamw", "adamw fused", "sparseloco")}
    n = sum(p.numel() for p in models["adamw"].parameters())
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}; "
          f"GPT {args.n_layer} x {args.n_embd}, {n / 1e6:.1f}M parameters, batch {args.batch} x {args.context}"
          f"{', bf16 autocast' if args.bf16 else ''}")
    print(check_bytes(models["adamw"], args, device))
    h = args.sync_every
    adamw = lambda ps, **kw: torch.optim.AdamW(ps, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    opts = {"adamw": adamw(models["adamw"].parameters()),
            "adamw fused": adamw(models["adamw fused"].parameters(), fused=True),
            "sparseloco": SparseLoCo(models["sparseloco"].parameters(), inner=adamw, sync_every=h, overlap=True,
                                     delay=args.delay, topk=args.topk, chunk=args.chunk, indices=args.indices)}
    opts["sparseloco"].grouped = not args.per_tensor
    gen = torch.Generator().manual_seed(0)
    times = {name: [[] for _ in range(h)] for name in opts}
    for block in range(args.blocks + 2):
        for name, opt in opts.items():
            ids = [torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=gen).to(device)
                   for _ in range(h)]
            step = lambda x, y, model=models[name], opt=opt: _train_step(model, opt, x, y, args.bf16)
            for i, t in enumerate(step_times(step, lambda i: (ids[i][:, :-1], ids[i][:, 1:]), h)):
                if block >= 2:
                    times[name][i].append(t)
    sl = opts["sparseloco"]              # whole rounds ran: the last sync is in flight, its own rows kept
    extra = second_row_landing(models["sparseloco"], device, sl, sl.sync.message.payload)
    report(times, h, args.delay, extra)
    if args.profile:
        profile_round(lambda ids: _train_step(models["sparseloco"], sl, ids[:, :-1], ids[:, 1:], args.bf16),
                      args, h, device)
    dist.destroy_process_group()


def profile_round(step, args, h, device) -> None:
    """One round of SparseLoCo's training steps under torch.profiler: the ops by self time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    batches = [torch.randint(0, args.vocab, (args.batch, args.context + 1)).to(device) for _ in range(h)]
    with profile(activities=activities) as prof:
        for ids in batches:
            step(ids)
        _sync(device)
    for key in (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=48))


def report(times, h, delay, extra) -> None:
    sync, landing = h - 1, (h - 1 + delay) % h
    by = {name: [statistics.median(t) for t in per] for name, per in times.items()}
    print("\n| step (medians, ms) | " + " | ".join(f"{i + 1}" for i in range(h)) + " | round |")
    print("|---|" + "---|" * (h + 1))
    for name, steps in by.items():
        label = name if name != "sparseloco" else f"sparseloco (sync at {sync + 1}, lands at {landing + 1})"
        print(f"| {label} | " + " | ".join(f"{1e3 * t:.1f}" for t in steps) + f" | {1e3 * sum(steps):.1f} |")
    round_ms = 1e3 * (sum(by["sparseloco"]) + extra)
    print(f"| sparseloco + a second rank's decode and mean ({1e3 * extra:.1f}) |" + " |" * h + f" {round_ms:.1f} |")
    for base in ("adamw", "adamw fused"):
        step = statistics.median(by[base])
        print(f"\nround / {h} x {base}'s step ({1e3 * step:.1f} ms): {round_ms / (1e3 * h * step):.3f}")


if __name__ == "__main__":
    main()
