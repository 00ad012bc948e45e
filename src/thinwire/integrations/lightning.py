"""A thinwire optimizer under PyTorch Lightning: `ThinwireDDPStrategy`, a `DDPStrategy` whose
DDP all-reduces no gradient and whose checkpoints hold every rank's optimizer state.

    from thinwire.integrations.lightning import ThinwireDDPStrategy
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ThinwireDDPStrategy(), max_steps=20)
    trainer.fit(module)                    # configure_optimizers returns a thinwire optimizer
    trainer.fit(module, ckpt_path="...")   # every rank resumes with its own optimizer state

Under torchrun, Lightning reads the launcher's environment and does not spawn. What changes
against `DDPStrategy` (it takes the same arguments):
- DDP is built with `forward_sync_buffers=False` (older torch: `broadcast_buffers=False`)
  and `keep_gradients_local` registered on every device (DDPStrategy registers its
  `ddp_comm_hook` on CUDA only): backward leaves each rank's own gradient, and the thinwire
  optimizer is the only thing that communicates. Every optimizer must therefore be a thinwire
  optimizer (ValueError otherwise: a dense one would step on unaveraged gradients and the
  replicas would drift apart).
- `optimizer_state` (called on every rank by Lightning's `dump_checkpoint`) all-gathers every
  rank's state through `PerRankState`; rank 0 writes the file; `load_optimizer_state_dict`
  gives each rank its own (and, for LoRDO/DiLoCo, its own parameters, copied back after
  Lightning loaded the model's). A checkpoint saved by another strategy is refused.
- At the end of fitting each optimizer is flushed: a step in flight under `overlap=True`
  lands in the final model. Checkpoints are not flushed: the state records the step in flight.
- A checkpoint is complete or absent: rank 0 writes it into `<path>.tmp`, fsyncs it and
  renames it over `<path>` (a local path; another filesystem's through the CheckpointIO as
  is), so a crash mid-write leaves the previous file. `fit(ckpt_path="last")` (Lightning
  takes the newest `last*.ckpt`, never a `.tmp`) with `ModelCheckpoint(save_last=True)` then
  resumes from the newest complete checkpoint, and rank 0 prints one line naming each
  `.ckpt.tmp` newer than the file it resumes from, which it skipped. (`save_last="link"`
  replaces the link by remove, then create: a crash between the two leaves no "last".)
- `find_unused_parameters=True` is refused: DDP would all-reduce its used-parameter map in
  every backward, traffic beside the optimizer's.
Gradient accumulation (`accumulate_grad_batches`: Lightning's no_sync, then one `step()`) and
lr schedulers work as usual. `gradient_clip_val` clips each rank's *local* gradient (nothing
is averaged before the optimizer). Not supported: FSDP/DeepSpeed/other strategies, manual
optimization (untested), checkpoints at another world size. Depends on Lightning's internal
order of checkpoint calls (read in 2.6.6's source: `optimizer_state` on every rank, optimizers
restored after the model) and on `DDPStrategy.configure_ddp`; the [lightning] extra's range,
2.4 <= v < 2.7, is enforced (RuntimeError outside).
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any

import lightning
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from ..optim.base import CommunicatingOptimizer
from .ddp import keep_gradients_local
from .state import PerRankState

TESTED = ((2, 4), (2, 7))          # [lowest, first untested): where the behaviour above was read
# DDP's flag for the buffer broadcast before every forward (the buffers are still synced once at start)
_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters
SYNC_BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
TEMP_SUFFIX = ".tmp"     # Lightning's "last" takes `last*.ckpt` files only: a file being written is never one
REFUSED = ("ddp_comm_hook", "ddp_comm_wrapper", "ddp_comm_state", "model_averaging_period")


def check_lightning_version(version: str = lightning.__version__) -> None:
    """RuntimeError unless 2.4 <= `version` < 2.7, the releases whose checkpoint order was checked."""
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor is None or not TESTED[0] <= major_minor < TESTED[1]:
        raise RuntimeError(f"ThinwireDDPStrategy is tested with lightning >= 2.4, < 2.7 (it relies on the order in "
                           f"which Lightning saves and restores checkpoints), found {version}")


def write_whole(path, write) -> None:
    """`write(tmp)` writes the file at `tmp`, `<path>.tmp`; it is fsynced and renamed over `path`
    (the directory fsynced too): `path` is the old file or the whole new one, never a part."""
    path = os.fspath(path)
    tmp = path + TEMP_SUFFIX
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)                       # the rename itself survives a power loss
    finally:
        os.close(directory)


def skipped(path, step) -> str | None:
    """One line naming each `*.ckpt.tmp` beside `path` newer than it (a write that never
    finished, skipped by resuming from `path`, of step `step`), or None."""
    path = Path(path)
    if not path.is_file():
        return None
    since = path.stat().st_mtime                  # a link's target's: when that checkpoint was written
    left = sorted(p.name for p in path.parent.glob(f"*.ckpt{TEMP_SUFFIX}") if p.stat().st_mtime >= since)
    if not left:
        return None
    return ("thinwire: skipped incomplete checkpoint " + ", ".join(left) + " (a write that never finished: never "
            f"renamed to its .ckpt); resuming from {path.name} (step {step})")


def _unwrap(optimizer):
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class ThinwireDDPStrategy(DDPStrategy):
    """DDPStrategy for thinwire optimizers: no gradient all-reduce, per-rank optimizer state in
    checkpoints written whole or not at all, a final flush (module docstring). Takes DDPStrategy's
    arguments except those that would communicate gradients (a DDP comm hook, post-local-SGD),
    broadcast buffers, or all-reduce the used-parameter map (find_unused_parameters=True)."""

    strategy_name = "thinwire_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_lightning_version()
        for name in REFUSED:
            if kwargs.get(name) is not None:
                raise ValueError(f"ThinwireDDPStrategy does not take {name}: the thinwire optimizer communicates, "
                                 f"DDP keeps gradients local")
        for name in ("broadcast_buffers", "forward_sync_buffers"):
            if kwargs.get(name):
                raise ValueError(f"ThinwireDDPStrategy needs {name}=False: a buffer broadcast before every "
                                 f"forward is dense traffic the optimizer does not account for")
        if kwargs.get("find_unused_parameters"):
            raise ValueError("ThinwireDDPStrategy needs find_unused_parameters=False (DDPStrategy's default): with "
                             "True, DDP all-reduces its used-parameter map in every backward, traffic beside the "
                             "optimizer's")
        if "broadcast_buffers" not in kwargs:         # newer torch deprecates broadcast_buffers
            kwargs.setdefault(SYNC_BUFFERS, False)
        super().__init__(*args, **kwargs)
        self._loaded_from = None                  # the checkpoint being restored: refusals name it

    def configure_ddp(self) -> None:
        super().configure_ddp()
        keep_gradients_local(self.model)          # on CPU too: DDPStrategy registers comm hooks on CUDA only

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if not isinstance(_unwrap(optimizer), CommunicatingOptimizer):
                raise ValueError(f"configure_optimizers returned {type(_unwrap(optimizer)).__name__}: under "
                                 f"ThinwireDDPStrategy gradients stay local, so every optimizer must be a thinwire "
                                 f"optimizer (a dense one would step on unaveraged gradients)")

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Rank 0 writes `filepath` whole or not at all (module docstring)."""
        if self.is_global_zero and isinstance(get_filesystem(filepath), LocalFileSystem):
            write_whole(filepath, lambda tmp: self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options))
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._loaded_from = checkpoint_path
        line = skipped(checkpoint_path, checkpoint.get("global_step"))
        if line and self.is_global_zero:
            print(line, file=sys.stderr, flush=True)
        return checkpoint

    def optimizer_state(self, optimizer) -> dict:
        # a collective: Lightning's dump_checkpoint calls this on every rank, rank 0 writes the result
        return PerRankState(_unwrap(optimizer)).state_dict()

    def load_optimizer_state_dict(self, checkpoint) -> None:
        # after the model's weights: LoRDO/DiLoCo's own parameters overwrite the loaded replica
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(states)} optimizer states, the module has "
                             f"{len(self.optimizers)} optimizers")
        for optimizer, state in zip(self.optimizers, states):
            per_rank = PerRankState(_unwrap(optimizer))
            per_rank.source = f"checkpoint {self._loaded_from}"
            per_rank.load_state_dict(state)
            _optimizer_to_device(_unwrap(optimizer), self.root_device)

    def on_train_end(self) -> None:
        super().on_train_end()
        for optimizer in self.optimizers:
            _unwrap(optimizer).flush()            # the step in flight under overlap=True lands
