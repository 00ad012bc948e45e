"""Resuming a harness run at another world size (flat layout): checkpoint.load's half for a
checkpoint of W ranks loaded by W' != W ranks.

    blob = new_rank_blob(blobs, built, rank, world, seed, step)   # blobs[i]: old rank i's "rank{i}"
    line = announcement(path, old_world, world, rule(built, old_world, world))

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

import torch

from ..optim.base import CommunicatingOptimizer
from ..optim.elastic import mix, mixing_weights, remap


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
