"""Hugging Face `transformers.Trainer` with a thinwire optimizer: no dense gradient all-reduce,
every rank's own optimizer state in the checkpoints.

    from thinwire import DeMo
    from thinwire.integrations.hf_trainer import ThinwireTrainer
    args = TrainingArguments(..., ddp_broadcast_buffers=False, ddp_find_unused_parameters=False)
    opt = DeMo(model.parameters(), lr=1e-3, topk=32)   # after TrainingArguments: it initialises torch.distributed
    trainer = ThinwireTrainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()                        # or train(resume_from_checkpoint=path or True)

Under torchrun, Trainer wraps the model in DDP (all-reduces every gradient in backward) and
checkpoints rank 0's optimizer.state_dict(), which it loads on every rank. `ThinwireTrainer`
adds a callback (`ThinwireCallback`, usable on its own with a reference to the trainer):
- on_train_begin (Trainer has wrapped the model and, on a resume, loaded rank 0's
  optimizer.pt): `keep_gradients_local(trainer.model_wrapped)`, then, on a resume, this rank's
  own state from `thinwire-rank{r}.pt` (LoRDO/DiLoCo: its own parameters too, copied over
  the loaded model). The RNG is Trainer's, already saved and restored per rank.
- on_save (every rank, after Trainer wrote checkpoint-N): each rank writes its own
  `optimizer.state_dict()` to checkpoint-N/thinwire-rank{r}.pt. No collective anywhere here,
  so nothing can wait on a rank that does not come. Under overlap=True the state records the
  step in flight and a resume sends it again: nothing is flushed before a save (a flush would
  land that step early and change the run).
- on_train_end: `optimizer.flush()` (a collective every rank reaches), so the final model
  holds the step still in flight under overlap=True.
The scheduler is TrainingArguments' (`optimizers=(opt, None)`); gradient accumulation
accumulates locally (one step() per optimizer step); `max_grad_norm` clips each rank's *local*
gradient. With `ddp_find_unused_parameters` True (Trainer's default for a PreTrainedModel)
DDP still all-reduces its used-parameter map in backward (4 bytes per parameter tensor, no
gradient): set it False unless the model has parameters some forward leaves unused.
Not supported (ValueError): an optimizer built before TrainingArguments (which initialises
torch.distributed; it would train alone), DeepSpeed, FSDP, load_best_model_at_end (it loads
rank 0's model on every rank), ddp_broadcast_buffers not False, a resume that bypasses
`ThinwireTrainer.train` or changes the world size. Nor hyperparameter search (its
checkpoints live elsewhere). Relies on the order of Trainer's private training loop
(above), tested on transformers 5.24.0; other versions outside TESTED are refused.
"""

from __future__ import annotations

import os

import torch
import transformers
from packaging.version import Version
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..optim.base import CommunicatingOptimizer
from ..optim.periodic import PeriodicAveraging
from .ddp import keep_gradients_local
from .state import _to_cpu

TESTED = ("5.0", "6.0")          # [low, high), refused outside; 5.24.0 is the version tested
FORMAT = "thinwire-hf-trainer-rank-state"


def rank_file(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, f"thinwire-rank{rank}.pt")


def check_trainer(args, optimizer) -> None:
    """ValueError for a transformers version outside TESTED or a configuration thinwire cannot
    keep its guarantees under, naming the argument."""
    low, high = TESTED
    if not Version(low) <= Version(Version(transformers.__version__).base_version) < Version(high):
        raise ValueError(f"thinwire's Trainer integration relies on the order of Trainer's training loop, checked "
                         f"for transformers >={low},<{high}; this is {transformers.__version__}")
    if not isinstance(optimizer, CommunicatingOptimizer):
        raise ValueError(f"optimizers=(optimizer, scheduler) must hold a thinwire optimizer, got "
                         f"{type(optimizer).__name__}: Trainer's own optimizer needs DDP's all-reduce")
    if args.world_size > 1 and optimizer.comm.group is None:
        raise ValueError("the optimizer was built before torch.distributed was initialised, so it trains alone: "
                         "build it after TrainingArguments(...), which initialises the process group")
    if args.ddp_broadcast_buffers is not False:
        raise ValueError("TrainingArguments(ddp_broadcast_buffers=False) is required: DDP would broadcast rank 0's "
                         "buffers before every forward (Llama's rotary frequencies are buffers)")
    for name in ("deepspeed", "fsdp", "load_best_model_at_end"):
        if getattr(args, name, None):
            raise ValueError(f"TrainingArguments({name}=...) is not supported with a thinwire optimizer")


class ThinwireCallback(TrainerCallback):
    """The callback of the module docstring; `trainer.train` must set `resume_from` to the
    checkpoint it resumes from (ThinwireTrainer does)."""

    def __init__(self, trainer: Trainer):
        optimizer = trainer.optimizer
        check_trainer(trainer.args, optimizer)
        self.trainer, self.optimizer = trainer, optimizer
        self.resume_from: str | None = None
        self._hooked: DistributedDataParallel | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if args.world_size > 1 and not isinstance(wrapped, DistributedDataParallel):
            raise ValueError(f"Trainer wrapped the model in {type(wrapped).__name__}, not DistributedDataParallel: "
                             f"thinwire's Trainer integration supports DDP only")
        if isinstance(wrapped, DistributedDataParallel) and wrapped is not self._hooked:
            self._hooked = keep_gradients_local(wrapped)   # a second train() may reuse the hooked DDP
        if self.resume_from is not None:
            self._load(self.resume_from, args.process_index, args.world_size)
        elif state.global_step > 0:                              # Trainer resumed, nobody told us from where
            raise ValueError("Trainer resumed from a checkpoint but ThinwireCallback.resume_from is unset: "
                             "every rank would keep rank 0's optimizer state; resume through ThinwireTrainer.train")

    def _load(self, checkpoint: str, rank: int, world: int) -> None:
        path = rank_file(checkpoint, rank)
        if not os.path.isfile(path):
            raise ValueError(f"{checkpoint} has no {os.path.basename(path)}: not saved by ThinwireTrainer, or cut "
                             f"before every rank wrote its state; rank {rank}'s optimizer state is not recoverable")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("format") != FORMAT or saved["world"] != world:
            raise ValueError(f"{path} was saved by {saved.get('world')} ranks, this run has {world}")
        self.optimizer.load_state_dict(saved["optimizer"])       # after Trainer loaded rank 0's
        if saved["params"] is not None:                          # LoRDO/DiLoCo: this rank's replica
            with torch.no_grad():
                for p, own in zip(self._params(), saved["params"], strict=True):
                    p.copy_(own)

    def on_save(self, args, state, control, **kwargs):
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(checkpoint, exist_ok=True)                   # rank 0 may not have created it yet
        params = None
        if isinstance(self.optimizer, PeriodicAveraging):
            params = [_to_cpu(p) for p in self._params()]
        blob = {"format": FORMAT, "world": args.world_size, "optimizer": _to_cpu(self.optimizer.state_dict()),
                "params": params}
        path = rank_file(checkpoint, args.process_index)
        torch.save(blob, path + ".tmp")
        os.replace(path + ".tmp", path)                          # a kill mid-write leaves no half file

    def on_train_end(self, args, state, control, **kwargs):
        self.optimizer.flush()


class ThinwireTrainer(Trainer):
    """`transformers.Trainer` with `ThinwireCallback` (module docstring). Takes Trainer's
    arguments; `optimizers=(thinwire optimizer, None or a scheduler)` is required. Another
    Trainer subclass gets it by inheritance: `class T(ThinwireTrainer, SFTTrainer)`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.thinwire = ThinwireCallback(self)
        self.add_callback(self.thinwire)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)     # as Trainer resolves it (it raises on None)
        self.thinwire.resume_from = path or None
        return super().train(resume_from_checkpoint, *args, **kwargs)
