"""A thinwire optimizer inside Hugging Face `transformers.Trainer`: no dense all-reduce, every
rank's state in the checkpoints. Trains a tiny random-init Llama on the stdlib's source
(nothing downloaded).

    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --optimizer demo --out runs/hf
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --save-at 5 --kill-mid-save 10 --out runs/a
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --resume last --out runs/a   # takes checkpoint-5
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --resume runs/a/checkpoint-5 --out runs/b
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --count --out runs/c    # every collective, wire-rank*.json
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --plain-ddp --count --out runs/d   # Trainer's defaults

What thinwire needs from a Trainer script, in the lines marked "thinwire:": `ThinwireTrainer`
instead of `Trainer`, the optimizer built after TrainingArguments (which initialises
torch.distributed) and passed in `optimizers=(opt, None)` (the scheduler comes from
TrainingArguments), and `ddp_broadcast_buffers=False` (plus
`ddp_find_unused_parameters=False`: no used-parameter map all-reduced in backward; left unset,
ThinwireTrainer sets both so). A checkpoint is complete only once every rank wrote its state
(`--kill-mid-save` cuts one in the middle: `--resume last` then takes the one before). Gradient
accumulation, clipping of the local gradient (`max_grad_norm`), checkpoints every
`save_steps` and `resume_from_checkpoint` are Trainer's own. `--plain-ddp` runs a plain
`Trainer` with the same arguments (DDP all-reduces every gradient, rank 0's optimizer state
is checkpointed and loaded on every rank): the baseline whose dense bytes `--count` shows.
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
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

from thinwire import DeMo, LoRDO
from thinwire.integrations import CollectiveCounter, end_worker
from thinwire.integrations.hf_trainer import ThinwireTrainer
from thinwire.train.data import load_corpus

OPTIMIZERS = {
    "demo": lambda ps: DeMo(ps, lr=1e-3, topk=32, chunk=64, overlap=True),   # a step in flight at every save
    "lordo": lambda ps: LoRDO(ps, lr=5e-3, rank=8, sync_every=4),     # 20 steps end on a sync
}
VOCAB, CONTEXT, WINDOWS = 256, 32, 1024


class Windows(torch.utils.data.Dataset):
    """Fixed, evenly spaced token windows of the corpus; the model shifts the labels itself."""

    def __init__(self, ids: torch.Tensor):
        stride = (ids.numel() - CONTEXT - 1) // WINDOWS
        self.rows = torch.stack([ids[i * stride:i * stride + CONTEXT] for i in range(WINDOWS)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class KillMidSave(TrainerCallback):
    """At the checkpoint of `step`, once rank 0 has written its thinwire state there, rank 1
    SIGKILLs itself before writing its own: a real crash in the middle of a checkpoint. Passed
    in `callbacks=`, so it runs before ThinwireTrainer's own on_save."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == 1:
            written = Path(args.output_dir) / f"checkpoint-{self.step}" / "thinwire-rank0.pt"
            deadline = time.monotonic() + 120
            while not written.is_file() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="demo", choices=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-at", type=int, default=0, help="checkpoint every this many steps (0: never)")
    p.add_argument("--save-total-limit", type=int, help="Trainer's save_total_limit")
    p.add_argument("--kill-mid-save", type=int, default=0, help="rank 1 dies while the checkpoint at this step is written")
    p.add_argument("--resume", help="a checkpoint directory, or 'last': the newest complete one in --out")
    p.add_argument("--plain-ddp", action="store_true", help="a plain Trainer: the dense all-reduce stays")
    p.add_argument("--count", action="store_true", help="count every collective (wire-rank<r>.json)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def training_arguments(args) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.out, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True, seed=0,
        ddp_broadcast_buffers=False,                              # thinwire: no buffer broadcast every forward
        ddp_find_unused_parameters=False,                         # thinwire: no used-parameter map in backward
        max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
        lr_scheduler_type="cosine", warmup_steps=4, logging_steps=10, dataloader_num_workers=0,
        save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or 500,
        save_total_limit=args.save_total_limit)


def build_model() -> LlamaForCausalLM:
    """A tiny Llama, random init, the same on every rank (seeded)."""
    set_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=CONTEXT))


def main(argv=None) -> None:
    args = parse_args(argv)
    model = build_model()
    targs = training_arguments(args)                             # initialises torch.distributed under torchrun
    opt = OPTIMIZERS[args.optimizer](list(model.parameters()))   # thinwire: after it (its peers are the world)
    trainer_class = Trainer if args.plain_ddp else ThinwireTrainer   # thinwire: ThinwireTrainer
    trainer = trainer_class(model=model, args=targs, train_dataset=Windows(load_corpus(None)[0]),
                            optimizers=(opt, None),               # thinwire: the optimizer; the scheduler from targs
                            callbacks=[KillMidSave(args.kill_mid_save)] if args.kill_mid_save else None)
    counter = CollectiveCounter().attribute(opt) if args.count else None
    resume = True if args.resume == "last" else args.resume
    with counter if counter is not None else contextlib.nullcontext():
        trainer.train(resume_from_checkpoint=resume)
    out, rank = Path(args.out), trainer.args.process_index
    torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), out / f"params-rank{rank}.pt")
    if counter is not None:
        wire = {"counter": counter.summary(), "comm_stats": opt.comm_stats.state_dict(),
                "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
        (out / f"wire-rank{rank}.json").write_text(json.dumps(wire))


if __name__ == "__main__":
    main()
    end_worker()                        # thinwire: no gloo abort at exit (thinwire.integrations.shutdown)
