"""Checkpoints of a harness run, with torch.distributed.checkpoint (DCP).

    root = checkpoint_root(out_dir)                   # <out>/checkpoint
    path = latest(root)                               # newest complete step-NNNNNN, or None
    check(path, expected_meta(cfg, name, lr, world))  # CheckpointError naming what differs (not the world size)
    check_resumable(out_dir, cfg, name, lr, world)    # latest + check of <out>/checkpoint, before the workers
    save(root, step, model, built, sched, meta, rank, keep=2)
    step = load(path, model, built, sched, rank)

A checkpoint is one DCP folder `<out>/checkpoint/step-NNNNNN/` holding
  * "model": the model's state dict (torch.distributed.checkpoint.state_dict; under FSDP2
    DTensor shards, so the checkpoint is sharded; a replicated model is saved once);
  * "rank{r}": rank r's own bytes (torch.save of a dict): its optimizer's state_dict()
    (thinwire optimizers' state is this rank's: error feedback, local momenta, EF21's
    server state on rank 0), the LR scheduler's state and the CPU (and CUDA) RNG state.
    A per-rank key is the point: DCP's planner keeps one copy of a value saved under the
    same key on every rank, which would silently replace every rank's error buffers by
    rank 0's (DeepSpeed 1-bit Adam's bug). With an optimizer whose replicas differ between
    syncs (`Built.replicas_drift`: LoRDO, DiLoCo) every rank's own parameters are saved
    there too: "model" holds one replica;
  * "optim": a plain torch optimizer's state (`Built.per_rank_state` False), under FSDP2
    HSDP its DTensor state, sharded (get_optimizer_state_dict), instead of per-rank bytes;
  * `thinwire.json` (rank 0): the step, optimizer, lr, world size, config, parameter shapes
    and the size of every file in the folder.
The step is the data position (data.train_batch is a pure function of the step). A flat run
(no --sites) resumes at any world size: every new rank then reads every old rank's
"rank{i}" and maps them (train/remap.py); a --sites checkpoint at another number of sites
with the same ranks per site: each new rank reads the old ranks that held its shard, one per
old site (another number of ranks per site is refused, naming both). DCP
writes into `step-NNNNNN.tmp`; rank 0 renames it once every rank has written and the
metadata is on disk, so a crash mid-write leaves the previous checkpoint as the latest
complete one; resuming then says on stderr, in one line, which incomplete folder it skipped,
why, and which step it takes instead (`skipped`). The newest `keep` complete checkpoints are
kept.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .config import RENAMED, TrainConfig
from .remap import layout, layout_text, new_rank_blob, peers

META = "thinwire.json"
_NAME = re.compile(r"^step-(\d{6,})$")
# Config fields a resumed run may change: evaluation does not touch the trajectory; the
# world size (checkpoint "world", config "workers") and, with the same ranks per site, the
# number of sites (checked in _layout_diffs) are mapped (train/remap.py).
MAY_DIFFER = ("eval_every", "workers", "sites")
# A config field added after a checkpoint was written: that run had the field's default.
_FIELD_DEFAULTS = TrainConfig().record()


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed (incomplete, corrupt, or from another run)."""


def checkpoint_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoint"


def _step_of(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def complete(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (renamed: written to the end)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None and (p / META).is_file()]
    return sorted(found, key=_step_of)


def latest(root: str | os.PathLike) -> Path | None:
    done = complete(root)
    return done[-1] if done else None


def skipped(root: str | os.PathLike) -> str | None:
    """One line naming each incomplete step folder (a `.tmp` never renamed, or one without its
    metadata) at or past the latest complete checkpoint under `root`, why it is incomplete,
    and the step a resume takes instead; None when there is none."""
    root, taken = Path(root), latest(root)
    names = {p: _step_of(p.with_name(p.name.removesuffix(".tmp"))) for p in (root.iterdir() if root.is_dir() else ())}
    found = sorted((step, p) for p, step in names.items() if step is not None and p.is_dir()
                   and not (p / META).is_file() and step >= (_step_of(taken) if taken else 0))
    if not found:
        return None
    why = lambda p: (f"no {META}, {len(list(p.iterdir()))} file(s) written: a rank stopped while writing it"  # noqa: E731
                     if p.name.endswith(".tmp") else f"no {META}: its metadata was never written or was removed")
    instead = f"resuming from {taken.name} (step {_step_of(taken)})" if taken else "no complete one: starting afresh"
    return "thinwire: skipped incomplete checkpoint " + "; ".join(f"{p.name} ({why(p)})" for _, p in found) + \
        f"; {instead}"


def _shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in model.named_parameters()}


def expected_meta(cfg, optimizer: str, lr: float, world: int, model: torch.nn.Module | None = None) -> dict:
    """What a checkpoint of this run must say about itself to be resumed by it."""
    meta = {"optimizer": optimizer, "lr": lr, "world": world, "config": cfg.record()}
    if model is not None:
        meta["params"] = _shapes(model)
    return meta


def check(path: Path, expect: dict) -> dict:
    """The checkpoint's metadata, or CheckpointError naming what is missing, truncated or differs."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is unreadable ({META}: {err})") from None
    for name, size in meta.get("files", {}).items():
        f = path / name
        have = f.stat().st_size if f.is_file() else None
        if have != size:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} is "
                                  f"{'missing' if have is None else f'{have} bytes'}, was written as {size} bytes"
                                  + _previous(path))
    diffs = [f"{key}: checkpoint {meta.get(key)!r}, this run {expect[key]!r}"
             for key in ("optimizer", "lr") if key in expect and meta.get(key) != expect[key]]
    saved, now = meta.get("config", {}), expect.get("config", {})
    diffs += _layout_diffs(meta.get("world", expect.get("world")), saved.get("sites") or 0,
                           expect.get("world", meta.get("world")), now.get("sites") or 0)
    saved = {RENAMED.get(k, k): v for k, v in saved.items()}      # written before the field's rename
    saved = {**_FIELD_DEFAULTS, **saved}    # a field newer than the checkpoint: it ran with its default
    for key in sorted(set(saved) | set(now)):
        if key not in MAY_DIFFER and saved.get(key) != now.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)!r}, this run {now.get(key)!r}")
    if "params" in expect and meta.get("params") != expect["params"]:
        diffs.append("parameter shapes differ: " + ", ".join(
            f"{n} {meta.get('params', {}).get(n)} vs {expect['params'].get(n)}"
            for n in sorted(set(meta.get("params", {})) | set(expect["params"]))
            if meta.get("params", {}).get(n) != expect["params"].get(n)))
    if diffs:
        raise CheckpointError(f"checkpoint {path} (step {meta.get('step')}) is from another run and cannot be "
                              f"resumed by this one: " + "; ".join(diffs) +
                              ". Resume with the flags it was written with, or give another --out")
    return meta


def _layout_diffs(old_world, old_sites: int, world, sites: int) -> list[str]:
    """What keeps a checkpoint of `old_world` ranks in `old_sites` sites (0: flat) from resuming
    on `world` ranks in `sites`: a flat run resumes at any world size, a --sites run at another
    number of sites with the same ranks per site (train/remap.py); flat and --sites not each other."""
    if bool(old_sites) != bool(sites):
        return [f"sites: checkpoint {old_sites!r}, this run {sites!r} (a flat run and a --sites run do not resume "
                f"each other)"]
    if not sites or old_world is None or world is None:
        return [] if old_sites == sites else [f"sites: checkpoint {old_sites!r}, this run {sites!r}"]
    old_per, per = old_world // old_sites, world // sites
    if old_per == per:
        return []
    return [f"ranks per site: checkpoint {old_per} ({layout_text(old_world, old_sites)}), this run {per} "
            f"({layout_text(world, sites)}); a --sites run resumes at another number of sites with the same ranks "
            f"per site only (each rank's optimizer state is its FSDP2 shard's; re-sharding it is not supported), "
            f"--workers = {old_per} x --sites: e.g. --workers {2 * old_per} --sites 2 or --workers {old_per} --sites 1"]


def _previous(path: Path) -> str:
    older = [p for p in complete(path.parent) if _step_of(p) < _step_of(path)]
    return (f"; remove it to resume from the previous checkpoint {older[-1]}" if older
            else "; remove it to start afresh")


def check_resumable(out_dir: str | os.PathLike, cfg, optimizer: str, lr: float, world: int,
                    announce: bool = True) -> None:
    """CheckpointError naming what differs or is corrupt unless the latest complete checkpoint
    under <out>/checkpoint (if any) can be resumed by this run: called before any worker starts
    (`thinwire train`, and every rank under torchrun). `announce`: say on stderr where it resumes."""
    root = checkpoint_root(out_dir)
    path, line = latest(root), skipped(root)
    if announce and line:
        print(line, file=sys.stderr, flush=True)
    if path is not None:
        meta = check(path, expected_meta(cfg, optimizer, lr, world))
        if announce and meta.get("world", world) == world:      # another world: rank 0 says how it maps
            print(f"thinwire: resuming {optimizer} from {path} (step {meta['step']} of {cfg.steps})", file=sys.stderr)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state(model, built, sched, rank: int, with_optimizer: bool, extra: dict | None = None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    opt = built.optimizer
    mine = {"scheduler": sched.state_dict(), "rng": _rng_state(), "extra": extra or {}}
    state = {"model": get_model_state_dict(model)}
    if not built.per_rank_state:                       # a torch optimizer: through DCP (sharded under HSDP)
        state["optim"] = get_optimizer_state_dict(model, opt)
    elif with_optimizer:
        mine["optimizer"] = opt.state_dict()           # an exchange in flight stays in flight, recorded
    if with_optimizer and built.replicas_drift:        # "model" holds one replica: each rank's own here
        mine["params"] = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    buf = io.BytesIO()
    if with_optimizer:
        torch.save(mine, buf)
    state[f"rank{rank}"] = buf
    return state


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(root: str | os.PathLike, step: int, model, built, sched, meta: dict, rank: int, keep: int = 2,
         extra: dict | None = None, before_write: Callable[[], None] | None = None) -> Path:
    """Write step `step`'s checkpoint under `root` (every rank calls this); its final path.
    `extra`: this rank's own picklable values (the loop's per-step byte counts), back from load().
    `before_write`, a test hook: called on this rank once DCP has planned the write, before
    this rank writes its shard (train/worker.py's THINWIRE_DIE_AT=rank:step:save kills it there)."""
    import torch.distributed.checkpoint as dcp
    root = Path(root)
    final, tmp = root / f"step-{step:06d}", root / f"step-{step:06d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_state(model, built, sched, rank, True, extra), storage_writer=_writer(tmp, before_write))
    _barrier()
    if rank == 0:
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        body = json.dumps({**meta, "step": step, "params": _shapes_of(model, meta), "files": files}, indent=1)
        with open(tmp / META, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def _writer(path: Path, before_write: Callable[[], None] | None):
    """DCP's FileSystemWriter for `path`, calling `before_write` first when it writes this rank's shard."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            if before_write is not None:
                before_write()
            return super().write_data(plan, planner)
    return Writer(str(path))


def _shapes_of(model, meta: dict) -> dict:
    return meta.get("params") or _shapes(model)


def load(path: str | os.PathLike, model, built, sched, rank: int, extra: dict | None = None) -> int:
    """Restore model, this rank's optimizer state, scheduler and RNG from `path`; its step.
    `extra` (a dict) is updated with what save() was given as this rank's `extra`.
    Written by another number of ranks: this rank's state is mapped from its old peers' (flat:
    every old rank's; --sites: the old ranks that held its shard; train/remap.py). A
    checkpoint DCP cannot read raises CheckpointError on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    path = Path(path)
    meta = json.loads((path / META).read_text())
    world = dist.get_world_size() if dist.is_initialized() else 1
    old = int(meta.get("world", world))
    old_sites, per_site = layout(old, meta.get("config", {}).get("sites") or 0)
    state = _state(model, built, sched, rank, False)
    if old != world:                           # the old peers' bytes: every old rank's (flat), its shard's (--sites)
        if world % per_site:
            raise CheckpointError(f"checkpoint {path} has {per_site} ranks per site; {world} ranks cannot keep that")
        del state[f"rank{rank}"]
        state.update({f"rank{i}": io.BytesIO() for i in peers(rank, old_sites, per_site)})
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as err:               # DCP gathers every rank's read errors and raises them on all
        raise CheckpointError(f"checkpoint {path} could not be read ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})"
                              + _previous(path)) from err
    set_model_state_dict(model, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(model, built.optimizer, state["optim"])
    if old == world:
        mine = _unpack(state[f"rank{rank}"])
    else:
        mine = new_rank_blob([_unpack(state[f"rank{i}"]) for i in peers(rank, old_sites, per_site)], built, rank,
                             world, meta.get("config", {}).get("seed", 0), int(meta["step"]), per_site)
    _restore(mine, model, built, sched, extra)
    return int(meta["step"])


def _unpack(blob) -> dict:
    if isinstance(blob, io.BytesIO):           # DCP hands back torch.load of the bytes, or fills the buffer
        blob.seek(0)
        blob = torch.load(blob, weights_only=False)
    return blob


def _restore(mine: dict, model, built, sched, extra: dict | None) -> None:
    if "params" in mine:                       # this rank's own replica (local steps since the last sync)
        with torch.no_grad():
            for n, p in model.named_parameters():
                _local(p).copy_(mine["params"][n])
    if "optimizer" in mine:
        built.optimizer.load_state_dict(mine["optimizer"])
    sched.load_state_dict(mine["scheduler"])
    if extra is not None:
        extra.update(mine.get("extra", {}))
    torch.set_rng_state(mine["rng"]["cpu"])
    if "cuda" in mine["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["rng"]["cuda"])


def read_model(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint, in this process (no process group):
    for comparing final parameters."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(str(path), out)
        state = torch.load(out, weights_only=False)
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")} or state.get("model", {})
