"""What every framework's checkpoint shares: whose a per-rank state is, and a commit mark.

Identity. Every per-rank state names its rank, the world size, the run and a fingerprint of
the run's layout (`identity`). The *run id* is a random token that names one training run:
agreed once at the start of a fresh run (rank 0's token, broadcast over the default group:
`agree_run_id`) and taken from the checkpoint on a resume (`adopt_run_id`), so the continued
run keeps it. It is kept per optimizer object, so every `PerRankState` built on the same
optimizer (Lightning builds one per save) agrees. The fingerprint hashes the optimizer's
class and, for a thinwire optimizer, the description its wire handshake agrees on
(`_describe(layout())`: every parameter's shape and dtype, the wire settings); for a torch
optimizer, the parameters' shapes and dtypes and the names of its settings (not their values:
schedulers change them). `check_identity` refuses a state of another rank, world, run or
layout with a ValueError that names both sides.

Commit. A checkpoint is complete or it does not exist: every rank writes its files, then
`commit` waits for all of them (a barrier on the default group: a dead peer makes gloo raise,
it does not hang) and rank 0 writes the mark (`MARK`), last. Before a rank writes into a
checkpoint directory it removes an old mark there (`uncommit`), so a second attempt at the
same directory is not complete until it has committed too. `latest_complete` finds the newest
complete checkpoint (one line on stderr for each newer incomplete one it skips),
`check_complete` refuses an incomplete one naming the newest complete one, and `rotate`
deletes old checkpoints without ever touching the newest complete one or anything newer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import weakref

import torch
import torch.distributed as dist

MARK = "thinwire-complete.json"
MARK_FORMAT = "thinwire-checkpoint-commit"
_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # optimizer -> its run id


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- identity ---------------------------------------------------------------------------------
def fingerprint(optimizer: torch.optim.Optimizer) -> str:
    """A short hash of the run's layout as `optimizer` sees it (module docstring)."""
    from ..optim.base import CommunicatingOptimizer
    if isinstance(optimizer, CommunicatingOptimizer):
        text = optimizer._describe(optimizer.layout())
    else:
        text = "\n".join(f"{sorted(k for k in g if k != 'params')} "
                         + " ".join(f"{tuple(p.shape)}:{p.dtype}" for p in g["params"])
                         for g in optimizer.param_groups)
    return hashlib.sha256(f"{type(optimizer).__qualname__}\n{text}".encode()).hexdigest()[:16]


def run_id(optimizer: torch.optim.Optimizer) -> str | None:
    """The run `optimizer` trains in, once agreed or adopted; None before."""
    return _RUNS.get(optimizer)


def adopt_run_id(optimizer: torch.optim.Optimizer, run: str) -> None:
    """`optimizer` continues run `run` (a resume: the checkpoint's run id)."""
    _RUNS[optimizer] = run


def agree_run_id(optimizer: torch.optim.Optimizer) -> str:
    """`optimizer`'s run id; on the first call of a fresh run, rank 0's random token broadcast
    over the default group (a collective: every rank calls it). The token comes from the
    operating system, not torch's generator, so agreeing on it does not change training."""
    if optimizer in _RUNS:
        return _RUNS[optimizer]
    token = [secrets.token_hex(8)]
    if rank_and_world()[1] > 1:
        dist.broadcast_object_list(token, src=0)
    _RUNS[optimizer] = token[0]
    return token[0]


def identity(optimizer: torch.optim.Optimizer, rank: int, world: int, run: str | None) -> dict:
    """What a per-rank state of `optimizer` on `rank` of `world` in `run` says about itself."""
    return {"rank": rank, "world": world, "run": run, "optimizer": type(optimizer).__name__,
            "fingerprint": fingerprint(optimizer)}


def describe(ident: dict) -> str:
    return (f"rank {ident['rank']} of {ident['world']} in run {ident['run'] or '(not yet agreed)'} "
            f"({ident['optimizer']}, layout {ident['fingerprint']})")


def check_identity(saved: dict, mine: dict, source: str) -> None:
    """ValueError unless the state `source` holds (`saved`, an `identity`) is this rank's
    (`mine`): same world and rank, same run (when both know it), same layout."""
    reasons = [why for differs, why in (
        (saved["world"] != mine["world"], "another world size"),
        (saved["rank"] != mine["rank"], "another rank's state"),
        (None not in (saved["run"], mine["run"]) and saved["run"] != mine["run"], "another run's state"),
        (saved["fingerprint"] != mine["fingerprint"], "another optimizer or model layout"),
    ) if differs]
    if reasons:
        raise ValueError(f"{source} holds {describe(saved)}; this is {describe(mine)}: "
                         f"{' and '.join(reasons)}, refused before anything was loaded")


# ---- commit -----------------------------------------------------------------------------------
def uncommit(directory: str) -> None:
    """Remove `directory`'s commit mark, if any: call on every rank before writing into it."""
    try:
        os.remove(os.path.join(directory, MARK))
    except FileNotFoundError:
        pass


def commit(directory: str, content: dict) -> None:
    """Every rank has written its part of `directory`: wait for all of them, then rank 0 writes
    the mark holding `content` (a collective: every rank calls it)."""
    rank, world = rank_and_world()
    if world > 1:
        dist.barrier()
    if rank == 0:
        path = os.path.join(directory, MARK)
        with open(path + ".tmp", "w") as f:
            json.dump({"format": MARK_FORMAT, **content}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


def read_mark(directory: str) -> dict | None:
    """The commit mark's content, or None for an incomplete checkpoint."""
    try:
        with open(os.path.join(directory, MARK)) as f:
            mark = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return mark if mark.get("format") == MARK_FORMAT else None


def numbered(root: str, prefix: str) -> list[tuple[int, str]]:
    """(number, path) of the directories `prefix-N` or `prefix_N` in `root`, oldest first."""
    pattern = re.compile(rf"^{re.escape(prefix)}[-_](\d+)$")
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            match = pattern.match(name)
            if match and os.path.isdir(os.path.join(root, name)):
                found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def _incomplete_reason(path: str) -> str:
    return (f"it has no commit mark ({MARK}): the run stopped before every rank had written its "
            f"state there, or an older thinwire wrote it")


def latest_complete(root: str, prefix: str = "checkpoint", say: bool = True) -> str | None:
    """The newest complete checkpoint `prefix-N` (or `prefix_N`) in `root`, or None; with
    `say`, rank 0 prints one line on stderr for each newer incomplete one it skips."""
    for _, path in reversed(numbered(root, prefix)):
        if read_mark(path) is not None:
            return path
        if say and rank_and_world()[0] == 0:
            print(f"thinwire: skipping {path}: {_incomplete_reason(path)}", file=sys.stderr, flush=True)
    return None


def check_complete(path: str) -> dict:
    """The commit mark of checkpoint `path`; ValueError naming the newest complete checkpoint
    beside it when `path` is incomplete."""
    mark = read_mark(path)
    if mark is None:
        path = os.path.normpath(path)
        match = re.match(r"^(.*?)[-_]?\d+$", os.path.basename(path))
        newest = latest_complete(os.path.dirname(path), match.group(1), say=False) if match else None
        raise ValueError(f"{path} is incomplete: {_incomplete_reason(path)}; the newest complete checkpoint "
                         f"beside it is {newest or '(none)'}")
    return mark


def rotate(root: str, prefix: str, limit: int | None, keep: tuple[str, ...] = ()) -> None:
    """Keep the newest `limit` complete checkpoints `prefix-N` of `root` (and `keep`); delete
    older ones, incomplete older ones too. The newest complete one and anything newer than it
    (a save another rank may be writing) are never touched. Rank 0 calls it after `commit`."""
    if not limit or limit <= 0:
        return
    found = numbered(root, prefix)
    complete = [n for n, path in found if read_mark(path) is not None]
    if not complete:
        return
    older = [(n, path) for n, path in found if n < complete[-1] and os.path.normpath(path) not in
             {os.path.normpath(k) for k in keep}]
    kept = {n for n in complete[-limit:]}
    for n, path in older:
        if n not in kept:
            shutil.rmtree(path, ignore_errors=True)
