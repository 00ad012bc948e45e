"""A thinwire optimizer under Hugging Face Accelerate: no dense all-reduce, every rank's state
in the checkpoint. Trains the harness's tiny GPT on the stdlib's source (nothing downloaded).

    torchrun --nproc-per-node 2 examples/accelerate_train.py --optimizer demo --steps 20 --out runs/acc
    torchrun --nproc-per-node 2 examples/accelerate_train.py --steps 20 --save-at 10 --out runs/a   # checkpoint at 10
    torchrun --nproc-per-node 2 examples/accelerate_train.py --steps 20 --resume runs/a/step-10 --out runs/b
    torchrun --nproc-per-node 2 examples/accelerate_train.py --count --out runs/c     # every collective, in wire-rank*.json
    torchrun --nproc-per-node 2 examples/accelerate_train.py --plain-ddp --count --out runs/d   # Accelerate's defaults

What thinwire needs from Accelerate, in four lines marked "thinwire:" below: DDP built with
broadcast_buffers=False, its gradient all-reduce replaced by `keep_gradients_local`, the
optimizer kept out of `accelerator.prepare` (Accelerate would save rank 0's state and load it
on every rank), and `PerRankState` registered for checkpointing instead. Gradient
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
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel

from thinwire import APMSqueeze, DeMo, LoRDO
from thinwire.integrations import CollectiveCounter, PerRankState, end_worker, keep_gradients_local
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
    p.add_argument("--save-at", type=int, default=0, help="save_state after this optimizer step (0: never)")
    p.add_argument("--kill-after-save", action="store_true", help="every rank SIGKILLs itself after that checkpoint")
    p.add_argument("--resume", help="a save_state directory to resume from")
    p.add_argument("--plain-ddp", action="store_true", help="Accelerate's defaults: the dense all-reduce stays")
    p.add_argument("--count", action="store_true", help="count every collective (wire-rank<r>.json)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def prepare(accelerator: Accelerator, args):
    """(model, optimizer, scheduler, step counter), set up as thinwire needs (or, with
    --plain-ddp, as Accelerate does by default)."""
    model = accelerator.prepare(build_model(get_preset("tiny")))   # thinwire: the model only, not the optimizer
    if isinstance(model, DistributedDataParallel) and not args.plain_ddp:
        keep_gradients_local(model)                                # thinwire: DDP all-reduces nothing
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
    if args.resume:
        accelerator.load_state(args.resume)
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
        if step.value == args.save_at:
            accelerator.save_state(str(out / f"step-{step.value}"))
            if args.kill_after_save:
                accelerator.wait_for_everyone()                    # every rank's files are written
                os.kill(os.getpid(), signal.SIGKILL)
    inner.flush()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(torch.cat([t.detach().reshape(-1) for t in model.parameters()]), out / f"params-rank{rank}.pt")
    if counter is not None:
        wire = {"counter": counter.summary(), "comm_stats": inner.comm_stats.state_dict(),
                "parameters": sum(t.numel() for t in model.parameters())}
        (out / f"wire-rank{rank}.json").write_text(json.dumps(wire))


def main(argv=None) -> None:
    args = parse_args(argv)
    ddp_kwargs = DistributedDataParallelKwargs(broadcast_buffers=False)        # thinwire: no buffer broadcast
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate, kwargs_handlers=[ddp_kwargs])
    counter = CollectiveCounter() if args.count else None
    with counter if counter is not None else contextlib.nullcontext():
        train(accelerator, args, counter)


if __name__ == "__main__":
    main()
    end_worker()                        # thinwire: no gloo abort at exit (thinwire.integrations.shutdown)
