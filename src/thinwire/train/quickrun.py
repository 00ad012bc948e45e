"""A short DeMo run on 2 real gloo workers: byte-level language model on local text.

    thinwire quickrun --workers 2 --steps 60

Each worker trains the same small next-byte model on its own shard of every batch, drawn
from the Python standard library's own source (nothing is downloaded), with DeMo as the
only thing that communicates. Rank 0 prints loss and bytes per step, then the bytes a
dense fp32 all-reduce would have sent for the same steps.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from ..optim import DeMo
from .launch import launch

CONTEXT, WIDTH = 16, 128


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    """The first `limit` bytes of the stdlib's .py files (tests excluded), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or any(part in ("test", "tests") for part in rel):
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 32), torch.nn.Flatten(),                  # [B, CONTEXT] -> [B, CONTEXT*32]
        torch.nn.Linear(CONTEXT * 32, WIDTH), torch.nn.GELU(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 256))


def batch(data: torch.Tensor, step: int, rank: int, world: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of `rows` windows for `step`."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, data.numel() - CONTEXT - 1, (rows,), generator=gen)[rank::world]
    windows = data[starts[:, None] + torch.arange(CONTEXT + 1)]          # [rows/world, CONTEXT+1]
    return windows[:, :-1], windows[:, -1]


def _worker(rank: int, world: int, steps: int, rows: int, lr: float, topk: int) -> None:
    data = stdlib_bytes()
    model = make_model()
    opt = DeMo(model.parameters(), lr=lr, topk=topk)
    dense_bytes = 4 * sum(p.numel() for p in model.parameters())
    for step in range(steps):
        x, y = batch(data, step, rank, world, rows)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        s = opt.comm_stats
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.3f}  payload {s.last_step.payload_bytes:,} B"
                  f"  link sent {s.last_step.link_bytes_sent:,} B", flush=True)
    if rank == 0:
        print(f"DeMo sent {s.payload_bytes:,} payload bytes per worker over {steps} steps; "
              f"a dense fp32 all-reduce sends {dense_bytes * steps:,} "
              f"({dense_bytes * steps / s.payload_bytes:.0f}x more).")


def run(workers: int = 2, steps: int = 60, rows: int = 64, lr: float = 3e-3, topk: int = 16) -> None:
    if rows < workers:
        raise ValueError(f"rows ({rows}) must be >= workers ({workers})")
    launch(_worker, workers, args=(steps, rows, lr, topk))
