"""Hugging Face `transformers.Trainer` with a thinwire optimizer: no dense gradient all-reduce,
every rank's own optimizer state in the checkpoints, and checkpoints complete or absent.

    from thinwire import DeMo
    from thinwire.integrations.hf_trainer import ThinwireTrainer
    args = TrainingArguments(..., ddp_broadcast_buffers=False, ddp_find_unused_parameters=False)
    opt = DeMo(model.parameters(), lr=1e-3, topk=32)   # after TrainingArguments: it initialises torch.distributed
    trainer = ThinwireTrainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()                        # or train(resume_from_checkpoint=path or True)

Under torchrun, Trainer wraps the model in DDP (all-reduces every gradient in backward) and
checkpoints rank 0's optimizer.state_dict(), which it loads on every rank. `ThinwireTrainer`
adds a callback (`ThinwireCallback`, usable on its own with a reference to the trainer):
- `train` (before Trainer loads anything): a fresh run agrees on its run id (rank 0's token,
  one broadcast); a resume checks that the checkpoint is complete and that this rank's
  `thinwire-rank{r}.pt` there names this rank, the checkpoint's run and this layout
  (thinwire.integrations.commit; ValueError naming the file and both sides otherwise). The
  resumed run keeps the checkpoint's run id. `resume_from_checkpoint=True` takes the newest
  *complete* checkpoint, with one line on stderr for each newer incomplete one it skips; a path
  to an incomplete one is refused, naming the newest complete one.
- on_train_begin (Trainer has wrapped the model and, on a resume, loaded rank 0's
  optimizer.pt): `keep_gradients_local(trainer.model_wrapped, stop_buffer_sync=True)`, then,
  on a resume, this rank's own state (LoRDO/DiLoCo: its own parameters too, copied over the
  loaded model). The RNG is Trainer's, already saved and restored per rank.
- on_save (every rank, after Trainer wrote checkpoint-N): each rank writes its own state to
  checkpoint-N/thinwire-rank{r}.pt, then `commit`: a barrier on the default group (a dead
  peer makes gloo raise; it does not hang) and rank 0's commit mark, last. Trainer's rotation
  (`save_total_limit`) runs there, after the commit, and never deletes the newest complete
  checkpoint or a newer one (Trainer's own runs before the rank files exist: held back). Under
  overlap=True the state records the step in flight and a resume sends it again: nothing is
  flushed before a save (a flush would land that step early and change the run).
- on_train_end: `optimizer.flush()` (a collective every rank reaches), so the final model
  holds the step still in flight under overlap=True.
DDP settings: `ddp_find_unused_parameters=True` is refused (DDP would all-reduce its
used-parameter map in backward); left unset (Trainer's default turns it on for a
PreTrainedModel) it is set off. `ddp_broadcast_buffers=True` is refused; unset or False, the
per-forward buffer sync is switched off through DDP's current name for it
(`forward_sync_buffers`, torch >= 2.13), and `broadcast_buffers` is not passed to DDP (torch
warns that it is deprecated); with an older torch it is passed as before. Buffers are then
synced once, when DDP is built (replicas start equal, as thinwire requires anyway).
The scheduler is TrainingArguments' (`optimizers=(opt, None)`); gradient accumulation
accumulates locally (one step() per optimizer step); `max_grad_norm` clips each rank's *local*
gradient. Not supported (ValueError): an optimizer built before TrainingArguments (which
initialises torch.distributed; it would train alone), DeepSpeed, FSDP,
load_best_model_at_end (it loads rank 0's model on every rank), a resume that bypasses
`ThinwireTrainer.train` or changes the world size, checkpoints written before rank files
named their run (no commit mark: refused as incomplete). Nor hyperparameter search (its
checkpoints live elsewhere). Relies on the order of Trainer's private training loop (above),
tested on transformers 5.24.0; other versions outside TESTED are refused.
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import transformers
from accelerate.utils import DistributedDataParallelKwargs
from packaging.version import Version
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..optim.base import CommunicatingOptimizer
from ..optim.periodic import PeriodicAveraging
from .commit import (adopt_run_id, agree_run_id, check_complete, check_identity, commit, fingerprint, identity,
                     latest_complete, rotate, uncommit)
from .ddp import keep_gradients_local
from .state import _to_cpu

TESTED = ("5.0", "6.0")          # [low, high), refused outside; 5.24.0 is the version tested
FORMAT = "thinwire-hf-trainer-rank-state"
VERSION = 2                      # 2: the file names whose state it is (`identity`)
# torch >= 2.13 names DDP's per-forward buffer sync forward_sync_buffers and warns on broadcast_buffers
FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters


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
    if args.ddp_broadcast_buffers:
        raise ValueError("TrainingArguments(ddp_broadcast_buffers=True) is refused: DDP would broadcast rank 0's "
                         "buffers before every forward (Llama's rotary frequencies are buffers); leave it unset "
                         "or False")
    check_find_unused(args)
    for name in ("deepspeed", "fsdp", "load_best_model_at_end"):
        if getattr(args, name, None):
            raise ValueError(f"TrainingArguments({name}=...) is not supported with a thinwire optimizer")


def check_find_unused(args) -> None:
    if args.ddp_find_unused_parameters:
        raise ValueError("TrainingArguments(ddp_find_unused_parameters=True) is refused: DDP would all-reduce its "
                         "used-parameter map in backward; leave it unset (ThinwireTrainer sets it off) or False")


class ThinwireCallback(TrainerCallback):
    """The callback of the module docstring; `begin(checkpoint)` must run on every rank before
    Trainer's training loop (ThinwireTrainer.train calls it)."""

    def __init__(self, trainer: Trainer):
        optimizer = trainer.optimizer
        check_trainer(trainer.args, optimizer)
        self.trainer, self.optimizer = trainer, optimizer
        self._saved: dict | None = None              # this rank's checked state, loaded at train begin
        self._began = False
        self._hooked: DistributedDataParallel | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _identity(self, run: str | None) -> dict:
        args = self.trainer.args
        return identity(self.optimizer, args.process_index, args.world_size, run)

    def begin(self, checkpoint: str | None) -> None:
        """Before Trainer loads anything: a fresh run agrees on its run id (a broadcast); a resume
        checks that `checkpoint` is complete and that this rank's file there is its own, of
        that checkpoint's run and layout (ValueError naming both otherwise), and keeps it."""
        self._began, self._saved = True, None
        if checkpoint is None:
            agree_run_id(self.optimizer)
            return
        mark = check_complete(checkpoint)
        path = rank_file(checkpoint, self.trainer.args.process_index)
        if not os.path.isfile(path):
            raise ValueError(f"{checkpoint} is marked complete but has no {os.path.basename(path)}: "
                             f"not written by ThinwireTrainer")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("format") != FORMAT or saved.get("version") != VERSION:
            raise ValueError(f"{path} is not a ThinwireTrainer rank file of this version")
        check_identity(saved["identity"], self._identity(mark["run"]), path)
        adopt_run_id(self.optimizer, mark["run"])
        self._saved = saved

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if args.world_size > 1 and not isinstance(wrapped, DistributedDataParallel):
            raise ValueError(f"Trainer wrapped the model in {type(wrapped).__name__}, not DistributedDataParallel: "
                             f"thinwire's Trainer integration supports DDP only")
        if isinstance(wrapped, DistributedDataParallel) and wrapped is not self._hooked:
            # a second train() may reuse the hooked DDP; the sync is stopped by its current name
            self._hooked = keep_gradients_local(wrapped, stop_buffer_sync=True)
        if not self._began:
            raise ValueError("Trainer started without ThinwireCallback.begin: every rank would keep rank 0's "
                             "optimizer state on a resume; train through ThinwireTrainer.train")
        self._began = False
        if self._saved is not None:
            self.optimizer.load_state_dict(self._saved["optimizer"])       # after Trainer loaded rank 0's
            if self._saved["params"] is not None:                          # LoRDO/DiLoCo: this rank's replica
                with torch.no_grad():
                    for p, own in zip(self._params(), self._saved["params"], strict=True):
                        p.copy_(own)
            self._saved = None

    def on_save(self, args, state, control, **kwargs):
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(checkpoint, exist_ok=True)                   # rank 0 may not have created it yet
        params = None
        if isinstance(self.optimizer, PeriodicAveraging):
            params = [_to_cpu(p) for p in self._params()]
        run = agree_run_id(self.optimizer)                       # agreed in begin(): no collective here
        blob = {"format": FORMAT, "version": VERSION, "identity": self._identity(run),
                "optimizer": _to_cpu(self.optimizer.state_dict()), "params": params}
        path = rank_file(checkpoint, args.process_index)
        torch.save(blob, path + ".tmp")
        os.replace(path + ".tmp", path)                          # a kill mid-write leaves no half file
        commit(checkpoint, {"run": run, "world": args.world_size, "step": state.global_step,
                            "fingerprint": fingerprint(self.optimizer)})
        if args.process_index == 0:
            best = state.best_model_checkpoint
            rotate(args.output_dir, PREFIX_CHECKPOINT_DIR, args.save_total_limit, keep=(best,) if best else ())

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

    def _build_accelerator_args(self, **kwargs) -> dict:
        """Trainer's DDP settings, as thinwire needs them: find_unused_parameters off (refused
        when asked for), and no broadcast_buffers where DDP has forward_sync_buffers (the
        per-forward sync is stopped by that name in `keep_gradients_local`: no FutureWarning)."""
        check_find_unused(self.args)                             # runs inside Trainer.__init__
        built = super()._build_accelerator_args(**kwargs)
        for handler in built.get("kwargs_handlers", []):
            if isinstance(handler, DistributedDataParallelKwargs):
                handler.find_unused_parameters = False
                if FORWARD_SYNC:
                    handler.broadcast_buffers = DistributedDataParallelKwargs.broadcast_buffers   # not passed
        return built

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's save, with this rank's old commit mark removed first and Trainer's rotation
        left to `on_save`, after the commit (Trainer's would run before every rank has written)."""
        uncommit(os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """Trainer's train. `resume_from_checkpoint=True` takes the newest *complete* checkpoint
        (one line on stderr for each newer incomplete one skipped); a path to an incomplete one
        is refused (ValueError naming the newest complete one)."""
        path = resume_from_checkpoint or None
        if path is True:
            path = latest_complete(self.args.output_dir, PREFIX_CHECKPOINT_DIR)
            if path is None:
                raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {self.args.output_dir}")
        self.thinwire.begin(path)
        if path is not None and self.args.process_index == 0:
            print(f"thinwire: resuming from {path}", file=sys.stderr, flush=True)
        return super().train(path, *args, **kwargs)
