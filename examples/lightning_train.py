"""A thinwire optimizer under PyTorch Lightning: no dense all-reduce, every rank's state in the
checkpoint. Trains the harness's tiny GPT on the stdlib's source (nothing downloaded).

    torchrun --nproc-per-node 2 examples/lightning_train.py --optimizer demo --steps 20 --out runs/pl
    torchrun --nproc-per-node 2 examples/lightning_train.py --save-at 10 --out runs/a     # checkpoint every 10
    torchrun --nproc-per-node 2 examples/lightning_train.py --resume runs/a/step-10.ckpt --out runs/b
    torchrun --nproc-per-node 2 examples/lightning_train.py --save-at 5 --kill-in-save 10 --out runs/k
    torchrun --nproc-per-node 2 examples/lightning_train.py --save-at 5 --resume last --out runs/k  # from step 5
    torchrun --nproc-per-node 2 examples/lightning_train.py --count --out runs/c     # every collective, wire-rank*.json
    torchrun --nproc-per-node 2 examples/lightning_train.py --plain-ddp --count --out runs/d   # DDPStrategy()

What thinwire needs from Lightning is one line, marked "thinwire:" below: the strategy
`ThinwireDDPStrategy()` (DDP keeps gradients local, checkpoints hold every rank's optimizer
state and are written whole or not at all, the optimizer is flushed when fitting ends). `configure_optimizers` returns a thinwire
optimizer and a scheduler as usual; accumulation (one `step()` per 2 micro-batches) and
gradient clipping (of each rank's local gradient) are the Trainer's. `--plain-ddp` runs
`DDPStrategy()` instead: DDP all-reduces every gradient, rank 0's optimizer state is loaded
on every rank; the baseline whose dense bytes `--count` shows. Checkpoints go to
`<out>/step-N.ckpt` and `<out>/last.ckpt` (`save_last=True`, what `--resume last` takes);
`--kill-in-save N` is a crash test: rank 0 dies half way through writing checkpoint N.

Data: the batch of micro-step m is `train_batch(..., m, rank, world)`, and the loader starts at
micro-step `global_step * accumulate`, which Lightning has restored by the time it asks for
the loader. A resumed run sees the batches the uninterrupted one saw, although Lightning does
not fast-forward a loader (it would restart this one at its beginning).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import signal
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, IterableDataset

from thinwire import APMSqueeze, DeMo
from thinwire.integrations import CollectiveCounter, end_worker
from thinwire.integrations.lightning import ThinwireDDPStrategy
from thinwire.optim.checkpoints import INFLIGHT_KEY
from thinwire.train.config import get_preset
from thinwire.train.data import load_corpus, train_batch
from thinwire.train.model import build_model

OPTIMIZERS = {
    "demo": lambda ps: DeMo(ps, lr=1e-3, topk=32, chunk=64),
    "apmsqueeze": lambda ps: APMSqueeze(ps, lr=1e-3, warmup_steps=5),
    # each step's exchange applied by the next step(); the strategy's flush lands the last one
    "demo-overlap": lambda ps: DeMo(ps, lr=1e-3, topk=32, chunk=64, overlap=True),
}
ACCUMULATE = 2


class MicroBatches(IterableDataset):
    """This rank's batches of micro-steps start, start + 1, ...: a function of the micro-step."""

    def __init__(self, ids: torch.Tensor, cfg, start: int, rank: int, world: int):
        self.ids, self.cfg, self.start, self.rank, self.world = ids, cfg, start, rank, world

    def __iter__(self):
        for micro in itertools.count(self.start):
            yield train_batch(self.ids, self.cfg, micro, self.rank, self.world)


class TinyGPT(L.LightningModule):
    def __init__(self, optimizer: str, counter: CollectiveCounter | None = None):
        super().__init__()
        self.cfg, self.optimizer_name, self.counter = get_preset("tiny"), optimizer, counter
        self.model = build_model(self.cfg)
        self.train_ids = load_corpus(None, self.cfg.vocab_size)[0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        opt = OPTIMIZERS[self.optimizer_name](list(self.model.parameters()))
        if self.counter is not None:
            self.counter.attribute(opt)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self):
        # after a resume's restore, before any step: the counters the checkpoint held
        self.stats_at_start = self.trainer.optimizers[0].comm_stats.state_dict()

    def train_dataloader(self):
        # on resume the loops (global_step) are restored before this is called
        start = self.trainer.global_step * ACCUMULATE
        data = MicroBatches(self.train_ids, self.cfg, start, self.trainer.global_rank, self.trainer.world_size)
        return DataLoader(data, batch_size=None)


class DieMidWrite(TorchCheckpointIO):
    """Writes half of step `step`'s checkpoint, then SIGKILLs this process (rank 0, the one
    that writes, after every rank's optimizer state was gathered into it): a real crash in the
    middle of a write, nothing flushed or torn down. Other steps are written as usual."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if checkpoint["global_step"] != self.step:
            return super().save_checkpoint(checkpoint, path, storage_options)
        whole = io.BytesIO()
        torch.save(checkpoint, whole)
        with open(path, "wb") as f:               # the strategy's temporary file
            f.write(whole.getbuffer()[:whole.tell() // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="demo", choices=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-at", type=int, default=10, help="checkpoint every this many optimizer steps (0: never)")
    p.add_argument("--kill-in-save", type=int, default=0, metavar="STEP",
                   help="crash test: rank 0 SIGKILLs itself half way through writing step STEP's checkpoint")
    p.add_argument("--resume", help="a checkpoint (.ckpt) to resume from, or 'last': the newest complete in --out")
    p.add_argument("--plain-ddp", action="store_true", help="DDPStrategy(): the dense all-reduce stays")
    p.add_argument("--count", action="store_true", help="count every collective (wire-rank<r>.json)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.kill_in_save and (not args.save_at or args.kill_in_save % args.save_at):
        p.error("--kill-in-save needs --save-at, and a step that is a multiple of it")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    # an endless loader has no epoch end to checkpoint at; the one worker is the training thread
    warnings.filterwarnings("ignore", ".*(does not have many workers|IterableDataset).*")
    out = Path(args.out)
    counter = CollectiveCounter() if args.count else None
    module = TinyGPT(args.optimizer, counter)
    crash = {"checkpoint_io": DieMidWrite(args.kill_in_save)} if args.kill_in_save else {}
    strategy = DDPStrategy(**crash) if args.plain_ddp else ThinwireDDPStrategy(**crash)   # thinwire: the one change
    callbacks = [ModelCheckpoint(dirpath=out, filename="step-{step}", auto_insert_metric_name=False, save_top_k=-1,
                                 every_n_train_steps=args.save_at, save_last=True)] if args.save_at else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
                        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=1.0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        enable_checkpointing=bool(callbacks))
    with counter if counter is not None else contextlib.nullcontext():       # on the training thread
        trainer.fit(module, ckpt_path=args.resume)
    rank, opt = trainer.global_rank, trainer.optimizers[0]
    out.mkdir(parents=True, exist_ok=True)
    flat = torch.cat([t.detach().reshape(-1) for t in module.model.parameters()])
    torch.save(flat, out / f"params-rank{rank}.pt")
    if counter is not None:
        wire = {"counter": counter.summary(), "comm_stats": opt.comm_stats.state_dict(),
                "comm_stats_at_start": module.stats_at_start,                        # as restored by a resume
                "parameters": sum(t.numel() for t in module.model.parameters() if t.requires_grad),
                "in_flight_after_fit": INFLIGHT_KEY in opt.state_dict()}     # False: the final step landed
        (out / f"wire-rank{rank}.json").write_text(json.dumps(wire))


if __name__ == "__main__":
    main()
    end_worker()                        # thinwire: no gloo abort at exit (thinwire.integrations.shutdown)
