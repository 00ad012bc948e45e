"""Resuming a harness run: the worker's `resume_from` (load, announce, the "resume" log record
with the time to recover). How a checkpoint of W ranks is mapped onto W' != W ranks is
train/remap.py's, which checkpoint.load calls.

    step, inter_steps, record = resume_from(path, meta, model, built, sched, rank, world, optimizer)   # the worker's
    line = announcement(path, optimizer, old_world, world, rule(...), old_sites, sites)
"""

from __future__ import annotations

import os
import sys
import time

from .checkpoint import check, load
from .remap import layout_text, rule


def announcement(path: str | os.PathLike, optimizer: str, old_world: int, world: int, how: str,
                 old_sites: int = 0, sites: int = 0) -> str:
    if not sites:
        return (f"thinwire: resuming {os.path.basename(str(path))} of a {old_world}-worker {optimizer} run on "
                f"{world} workers: {how}")
    return (f"thinwire: resuming {optimizer}'s {os.path.basename(str(path))}, "
            f"{layout_text(old_world, old_sites)} -> {layout_text(world, sites)}: {how}")


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
    saved_meta = check(path, meta)
    old_world = saved_meta.get("world", world)
    old_sites, sites = saved_meta.get("config", {}).get("sites") or 0, meta.get("config", {}).get("sites") or 0
    saved = {}
    done = load(path, model, built, sched, rank, saved)
    how = "same world size: each rank its own"
    if old_world != world:
        how = rule(built, old_world, world, old_sites, sites)
        if rank == 0:
            print(announcement(path, optimizer, old_world, world, how, old_sites, sites), file=sys.stderr, flush=True)
    record = {"kind": "resume", "step": done, "checkpoint": os.path.basename(str(path)), "old_world": old_world,
              "world": world, **({"old_sites": old_sites, "sites": sites} if sites else {}), "mapping": how,
              "load_s": time.perf_counter() - t0}
    return done, saved.get("inter_steps", []), record
