"""One rank of a training run: the loop, its timing, its log.

    train_worker(rank, world, cfg, optimizer_name, lr, log_path, quiet)

Each step: this rank's shard of the batch, forward, backward, `opt.step()` (which
communicates), LR schedule (linear warmup, then cosine to `min_lr_frac`). Timed per step:
the whole step (`step_s`) and the time blocked in collectives (`comm_s`); `step_s - comm_s`
is the compute a modelled link adds its transfer time to. Blocked time is measured by
timing every collective call and wait (timing.py; PowerSGD's waits too, powersgd.py).
Validation (every `eval_every` steps and at the end) runs outside the timed region; its
loss is averaged over ranks with an uncounted harness all-reduce. Rank 0 writes one JSON
line per step and per evaluation to `log_path`, and a final record with the optimizer's
own cumulative comm stats.
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .data import load_corpus, train_batch, val_starts, windows
from .model import build_model
from .optimizers import get_optimizer
from .progress import Progress
from .timing import BLOCKED, install


def lr_factor(step: int, cfg) -> float:
    """Multiplier of the base lr at 0-based `step`: linear warmup, then cosine to min_lr_frac."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model, val_ids, starts, cfg, rank: int, world: int) -> float:
    """Mean validation loss over the run's fixed windows; each rank scores its share."""
    model.eval()
    mine = starts[rank::world]
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for chunk in mine.split(max(1, cfg.rows)):
        x, y = (t.to(device) for t in windows(val_ids, chunk, cfg.context))
        logits = model(x)
        total[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double()
        total[1] += y.numel()
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def _device() -> torch.device:
    """CUDA under NCCL (torchrun on GPUs: init_from_env set the device), else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _record(stats) -> dict:
    s = stats.last_step
    return {"payload_bytes": s.payload_bytes, "link_bytes_sent": s.link_bytes_sent,
            "link_bytes_received": s.link_bytes_received, "collectives": s.collectives}


def _timed_step(built, sched, x, y) -> dict:
    """One optimizer step; its loss, lr, wall time and time blocked in collectives."""
    BLOCKED[0] = 0.0
    t0 = time.perf_counter()
    if not built.counts_itself:
        built.stats.begin_step()              # PowerSGD communicates inside backward
    loss = F.cross_entropy(built.model(x).flatten(0, 1), y.flatten())
    loss.backward()
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=False)
    sched.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    return {"loss": float(loss.detach()), "lr": sched.get_last_lr()[0], "step_s": step_s,
            "comm_s": min(BLOCKED[0], step_s), **_record(built.stats)}


def train_worker(rank: int, world: int, cfg, optimizer: str, lr: float, log_path: str | None,
                 quiet: bool = True, data_path: str | None = None) -> None:
    """Train `cfg`'s model with `optimizer` at base `lr` on this rank; rank 0 logs to `log_path`."""
    install()                                       # time what the Communicator waits on
    train_ids, val_ids = load_corpus(data_path, cfg.vocab_size)
    device = _device()
    model = build_model(cfg).to(device)
    built = get_optimizer(optimizer).build(model, cfg, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda s: lr_factor(s, cfg))
    starts = val_starts(val_ids, cfg)
    log = open(log_path, "w") if (rank == 0 and log_path) else None
    bar = Progress(optimizer, cfg.steps, enabled=(rank == 0 and not quiet))
    try:
        val = evaluate(model, val_ids, starts, cfg, rank, world)
        _write(log, {"kind": "eval", "step": 0, "val_loss": val})
        for step in range(1, cfg.steps + 1):
            x, y = (t.to(device) for t in train_batch(train_ids, cfg, step - 1, rank, world))
            rec = _timed_step(built, sched, x, y)
            _write(log, {"kind": "step", "step": step, **rec})
            bar.update(step, rec["loss"], built.stats.payload_bytes)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                val = evaluate(model, val_ids, starts, cfg, rank, world)
                _write(log, {"kind": "eval", "step": step, "val_loss": val})
                bar.note(val)
        _write(log, {"kind": "final", "comm_stats": built.stats.state_dict(), "val_loss": val,
                     "n_params": sum(p.numel() for p in model.parameters())})
    finally:
        bar.close()
        if log:
            log.close()


def _write(log, record: dict) -> None:
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()
