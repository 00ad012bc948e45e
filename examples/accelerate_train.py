"""A thinwire optimizer under Hugging Face Accelerate: no dense all-reduce, every rank's state
in the checkpoint. Trains the harness's tiny GPT on the stdlib's source (nothing downloaded).

    torchrun --nproc-per-node 2 examples/accelerate_train.py --optimizer demo --steps 20 --out runs/acc
    torchrun --nproc-per-node 2 examples/accelerate_train.py --save-every 5 --kill-mid-save 10 --out runs/a
    torchrun --nproc-per-node 2 examples/accelerate_train.py --save-every 5 --resume last --out runs/a   # step 5's
    torchrun --nproc-per-node 2 examples/accelerate_train.py --resume runs/a/checkpoints/checkpoint_0 --out runs/b
    torchrun --nproc-per-node 2 examples/accelerate_train.py --count --out runs/c     # every collective, in wire-rank*.json
    torchrun --nproc-per-node 2 examples/accelerate_train.py --plain-ddp --count --out runs/d   # Accelerate's defaults

What thinwire needs from Accelerate, in the lines marked "thinwire:" below: DDP's gradient
all-reduce replaced and its per-forward buffer broadcast stopped by `keep_gradients_local(model,
stop_buffer_sync=True)` (Accelerate's DDP kwargs know only the deprecated broadcast_buffers,
which torch >= 2.13 warns about), the optimizer kept out of `accelerator.prepare` (Accelerate
would save rank 0's state and load it on every rank), `PerRankState` registered for
checkpointing instead, and thinwire's `save_state` / `load_state` around Accelerate's (with
automatic checkpoint naming): a checkpoint counts once every rank wrote its part, so a crash
in the middle of one (`--kill-mid-save`) resumes from the one before. Gradient
accumulation: the micro-batches' gradients add up locally; `step()` runs once per
`--accumulate` micro-batches, when `accelerator.sync_gradients` says so. `--plain-ddp` runs
Accelerate's defaults instead (DDP all-reduces every gradient, the optimizer goes through
`prepare`): the baseline whose dense bytes `--count` shows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.nn.parallel import DistributedDataParallel

from thinwire import APMSqueeze, DeMo, LoRDO
from thinwire.integrations import CollectiveCounter, PerRankState, end_worker, keep_gradients_local, load_state, save_state
from thinwire.train.config import get_preset
from thinwire.train.data import load_corpus, train_batch
from thinwire.train.model import build_model

OPTIMIZERS = {
    "demo": lambda ps: DeMo(ps, lr=1e-3, topk=32, chunk=64),
    "apmsqueeze": lambda ps: APMSqueeze(ps, lr=1e-3, warmup_steps=5),
    "lordo": lambda ps: LoRDO(ps, lr=5e-3, rank=8, sync_every=4),
}


class Step:
    """The optimizer-step counter, checkpointed beside everything else."""

    def __init__(self):
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="demo", choices=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--save-every", type=int, default=0, help="save_state every this many optimizer steps (0: never)")
    p.add_argument("--keep", type=int, help="how many checkpoints to keep (Accelerate's total_limit)")
    p.add_argument("--kill-mid-save", type=int, default=0, help="rank 1 dies while the checkpoint at this step is written")
    p.add_argument("--resume", help="a checkpoint directory, or 'last': the newest complete one in --out")
    p.add_argument("--plain-ddp", action="store_true", help="Accelerate's defaults: the dense all-reduce stays")
    p.add_argument("--count", action="store_true", help="count every collective (wire-rank<r>.json)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def prepare(accelerator: Accelerator, args):
    """(model, optimizer, scheduler, step counter), set up as thinwire needs (or, with
    --plain-ddp, as Accelerate does by default)."""
    model = accelerator.prepare(build_model(get_preset("tiny")))   # thinwire: the model only, not the optimizer
    if isinstance(model, DistributedDataParallel) and not args.plain_ddp:
        keep_gradients_local(model, stop_buffer_sync=True)         # thinwire: DDP all-reduces nothing
    opt = OPTIMIZERS[args.optimizer](list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    step = Step()
    if args.plain_ddp:
        opt = accelerator.prepare(opt)                             # rank 0's state, loaded on every rank
        accelerator.register_for_checkpointing(sched, step)
    else:
        accelerator.register_for_checkpointing(PerRankState(opt), sched, step)   # thinwire: every rank's state
    return model, opt, sched, step


def train(accelerator: Accelerator, args, counter: CollectiveCounter | None) -> None:
    cfg, rank, world = get_preset("tiny"), accelerator.process_index, accelerator.num_processes
    model, opt, sched, step = prepare(accelerator, args)
    inner = getattr(opt, "optimizer", opt)                         # under --plain-ddp, Accelerate wraps it
    if counter is not None:
        counter.attribute(inner)
    if args.resume:                                                # thinwire: a complete checkpoint, checked
        where = load_state(accelerator, None if args.resume == "last" else args.resume)
        if accelerator.is_main_process:
            print(f"resumed from {where} at step {step.value}", flush=True)
    if args.kill_mid_save:
        accelerator.register_save_state_pre_hook(kill_mid_save(args.kill_mid_save, step, rank))
    train_ids, _ = load_corpus(None, cfg.vocab_size)
    out = Path(args.out)
    while step.value < args.steps:
        for micro in range(args.accumulate):
            x, y = train_batch(train_ids, cfg, step.value * args.accumulate + micro, rank, world)
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
                if accelerator.sync_gradients:
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        step.value += 1
        if args.save_every and step.value % args.save_every == 0:
            save_state(accelerator)                                # thinwire: committed once every rank wrote
    inner.flush()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(torch.cat([t.detach().reshape(-1) for t in model.parameters()]), out / f"params-rank{rank}.pt")
    if counter is not None:
        wire = {"counter": counter.summary(), "comm_stats": inner.comm_stats.state_dict(),
                "parameters": sum(t.numel() for t in model.parameters())}
        (out / f"wire-rank{rank}.json").write_text(json.dumps(wire))


def kill_mid_save(at: int, step: Step, rank: int):
    """A save_state pre-hook: at the checkpoint of step `at`, rank 1 waits until rank 0 has
    written its own RNG state there, then SIGKILLs itself before writing its own (a real crash
    in the middle of a checkpoint; rank 0 is stopped by torchrun or gloo)."""
    def hook(models, weights, output_dir):
        if step.value == at and rank == 1:
            written, deadline = Path(output_dir) / "random_states_0.pkl", time.monotonic() + 120
            while not written.is_file() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def main(argv=None) -> None:
    args = parse_args(argv)
    project = ProjectConfiguration(project_dir=args.out, automatic_checkpoint_naming=True, total_limit=args.keep)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate, project_config=project)
    counter = CollectiveCounter() if args.count else None
    with counter if counter is not None else contextlib.nullcontext():
        train(accelerator, args, counter)


if __name__ == "__main__":
    main()
    end_worker()                        # thinwire: no gloo abort at exit (thinwire.integrations.shutdown)
