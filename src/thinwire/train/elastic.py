"""Resuming a harness run: the worker's `resume_from` (load, announce, the "resume" log record
with the time to recover) and, at another world size (flat layout), checkpoint.load's half
for a checkpoint of W ranks loaded by W' != W ranks.

    blob = new_rank_blob(blobs, built, rank, world, seed, step)   # blobs[i]: old rank i's "rank{i}"
    line = announcement(path, optimizer, old_world, world, rule(built, old_world, world))
    step, inter_steps, record = resume_from(path, meta, model, built, sched, rank, world, optimizer)   # the worker's

Every new rank reads every old rank's "rank{i}" blob (DCP lets any rank load any key) and
builds the one it would have saved itself:
  * its optimizer state: `thinwire.optim.elastic.remap` of the old ranks' states (the interval
    rule: new rank j = Σ_i A[j, i] × old rank i, A = `mixing_weights(W, W')`); a torch
    optimizer's state (saved under "optim", the same on every rank) is loaded by DCP as it is;
  * its own parameters, where replicas drift between syncs (LoRDO, DiLoCo): mixed by the same
    rule (`mix`), so the mean of the replicas, what the next sync reads, is unchanged;
  * the LR schedule: old rank 0's (it is the same on every rank);
  * the RNG: old rank j's when there was a rank j, else a generator seeded by
    `rng_seed(seed, step, rank)` (the run's seed, the step resumed at, the new rank);
  * its `extra` (the loop's per-rank byte history): old rank j's, else empty.
The model ("model", one replica) is re-loaded by DCP as it is. A `--sites` layout resumes only
at the world size it was written at (checkpoint.check refuses another one).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from ..optim.base import CommunicatingOptimizer
from ..optim.elastic import mix, mixing_weights, remap
from .checkpoint import check, load


def rng_seed(seed: int, step: int, rank: int) -> int:
    """The CPU RNG seed of a new rank that had no old counterpart."""
    return (seed * 1_000_003 + step) * 65_537 + rank


def _fmt(a: torch.Tensor) -> str:
    return "[" + ", ".join("[" + ", ".join(f"{x:.3g}" for x in row.tolist()) + "]" for row in a) + "]"


def rule(built, old_world: int, world: int) -> str:
    """How this run maps per-rank state from `old_world` ranks to `world`, in words."""
    if not built.per_rank_state:
        return "the optimizer state is the same on every rank (a torch optimizer under DDP): loaded as it is"
    text = (f"per-rank optimizer state mapped by the interval rule, new rank j = sum_i A[j, i] x old rank i with A = "
            f"{_fmt(mixing_weights(old_world, world))}")
    return text + (" (each rank's own parameters too)" if built.replicas_drift else "")


def announcement(path: str | os.PathLike, optimizer: str, old_world: int, world: int, how: str) -> str:
    return (f"thinwire: resuming {os.path.basename(str(path))} of a {old_world}-worker {optimizer} run on "
            f"{world} workers: {how}")


def new_rank_blob(blobs: list[dict], built, rank: int, world: int, seed: int, step: int) -> dict:
    """New rank `rank`'s blob (module docstring) from every old rank's `blobs`."""
    old = len(blobs)
    row = mixing_weights(old, world)[rank]
    mine = {"scheduler": blobs[0]["scheduler"], "extra": blobs[rank].get("extra", {}) if rank < old else {}}
    if rank < old:
        mine["rng"] = blobs[rank]["rng"]
    else:
        mine["rng"] = {"cpu": torch.Generator().manual_seed(rng_seed(seed, step, rank)).get_state()}
    if "optimizer" in blobs[0]:
        states = [b["optimizer"] for b in blobs]
        mine["optimizer"] = (remap(built.optimizer, states, rank) if isinstance(built.optimizer, CommunicatingOptimizer)
                             else states[0])                 # a torch optimizer: the same on every rank
    if "params" in blobs[0]:
        mine["params"] = {n: mix([b["params"][n] for b in blobs], row, f"parameter {n}") for n in blobs[0]["params"]}
    return mine


def process_started() -> float:
    """When this process started, as time.time() (Linux: /proc; elsewhere: now): a resumed
    run's time to recover counts from the command's start, its interpreter and imports included."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])          # field 22: starttime, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def resume_from(path, meta: dict, model, built, sched, rank: int, world: int, optimizer: str) -> tuple:
    """Load checkpoint `path` (checked against this run's `meta`; at another world size the
    per-rank state is mapped, new_rank_blob, and rank 0 says how): (step, this rank's
    inter-site byte history, the "resume" log record without its time to recover)."""
    t0 = time.perf_counter()
    old_world = check(path, meta).get("world", world)
    saved = {}
    done = load(path, model, built, sched, rank, saved)
    how = "same world size: each rank its own"
    if old_world != world:
        how = rule(built, old_world, world)
        if rank == 0:
            print(announcement(path, optimizer, old_world, world, how), file=sys.stderr, flush=True)
    record = {"kind": "resume", "step": done, "checkpoint": os.path.basename(str(path)), "old_world": old_world,
              "world": world, "mapping": how, "load_s": time.perf_counter() - t0}
    return done, saved.get("inter_steps", []), record
