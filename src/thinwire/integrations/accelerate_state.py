"""Hugging Face Accelerate's `save_state` / `load_state`, with checkpoints that are complete or
do not exist (thinwire.integrations.commit):

    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=out,
                              automatic_checkpoint_naming=True, total_limit=2))
    accelerator.register_for_checkpointing(PerRankState(opt), ...)
    save_state(accelerator)            # every rank; out/checkpoints/checkpoint_<i>, then its commit mark
    load_state(accelerator)            # every rank; the newest *complete* checkpoint_<i>

`save_state(accelerator, output_dir=None)` runs `accelerator.save_state` (rank 0 writes the
model and the custom objects, every rank its RNG state), then `commit`: a barrier, and rank 0's
mark, last. Accelerate's own `total_limit` would delete old checkpoints *before* the new one
is written; the helper holds it back and deletes after the commit (`rotate`), so a kill while
checkpoint N is written leaves checkpoint N−1. A directory of an earlier incomplete attempt
at the same name is cleared first (Accelerate refuses an existing one).

`load_state(accelerator, input_dir=None)`: no `input_dir` under automatic naming takes the
newest complete checkpoint (one line on stderr per newer incomplete one skipped) and sets
Accelerate's save iteration after it; an explicit incomplete one is refused naming the newest
complete one. Before Accelerate loads anything, every registered `PerRankState`'s file is
read and checked against the commit mark's run and this rank (ValueError naming the file and
both sides): the file is read twice, once here and once by Accelerate.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from .commit import (adopt_run_id, agree_run_id, check_complete, commit, fingerprint, latest_complete, numbered,
                     rank_and_world, read_mark, rotate, uncommit)
from .state import PerRankState

PREFIX = "checkpoint"            # Accelerate's automatic names: checkpoints/checkpoint_<iteration>


def _states(accelerator) -> list[tuple[int, PerRankState]]:
    """(index among the registered objects, the PerRankState) for each one registered."""
    found = [(i, obj) for i, obj in enumerate(accelerator._custom_objects) if isinstance(obj, PerRankState)]
    if not found:
        raise ValueError("accelerator has no PerRankState registered: "
                         "accelerator.register_for_checkpointing(PerRankState(optimizer)) first")
    return found


def _root(accelerator) -> str:
    return os.path.join(accelerator.project_dir, "checkpoints")


def _auto(accelerator) -> bool:
    return bool(accelerator.project_configuration.automatic_checkpoint_naming)


def save_state(accelerator, output_dir: str | None = None, **kwargs) -> str:
    """`accelerator.save_state(output_dir, **kwargs)` made complete-or-absent (module
    docstring); every rank calls it. Returns the checkpoint directory."""
    states = _states(accelerator)
    run = agree_run_id(states[0][1].optimizer)                   # a broadcast, on a fresh run's first save
    for _, state in states:
        adopt_run_id(state.optimizer, run)
    config = accelerator.project_configuration
    if _auto(accelerator):
        target = os.path.join(_root(accelerator), f"{PREFIX}_{accelerator.save_iteration}")
        if rank_and_world()[0] == 0 and os.path.isdir(target) and read_mark(target) is None:
            shutil.rmtree(target)                                # an attempt cut before its commit
        if rank_and_world()[1] > 1:
            dist.barrier()                                       # nobody sees it before rank 0 cleared it
    elif output_dir is None:
        raise ValueError("save_state: output_dir is required without automatic_checkpoint_naming")
    else:
        uncommit(output_dir)
    limit, config.total_limit = config.total_limit, None         # Accelerate's rotation runs before the save
    try:
        location = accelerator.save_state(output_dir, **kwargs)
    finally:
        config.total_limit = limit
    commit(location, {"run": run, "world": rank_and_world()[1],
                      "fingerprints": [fingerprint(state.optimizer) for _, state in states]})
    if _auto(accelerator) and rank_and_world()[0] == 0:
        rotate(_root(accelerator), PREFIX, limit)
    return location


def load_state(accelerator, input_dir: str | None = None, **kwargs) -> str:
    """`accelerator.load_state` of a complete checkpoint, checked first (module docstring);
    every rank calls it. Returns the checkpoint directory it loaded."""
    states = _states(accelerator)
    if input_dir is None:
        if not _auto(accelerator):
            raise ValueError("load_state: input_dir is required without automatic_checkpoint_naming")
        input_dir = latest_complete(_root(accelerator), PREFIX)
        if input_dir is None:
            raise ValueError(f"load_state: no complete checkpoint in {_root(accelerator)}")
    mark = check_complete(input_dir)
    for index, state in states:
        state.source = os.path.join(input_dir, f"custom_checkpoint_{index}.pkl")
        adopt_run_id(state.optimizer, mark["run"])               # the file must be of the mark's run
        state.check(torch.load(state.source, map_location="cpu", weights_only=False))
    accelerator.load_state(input_dir, **kwargs)
    if _auto(accelerator):
        number = {os.path.normpath(p): n for n, p in numbered(_root(accelerator), PREFIX)}
        if os.path.normpath(input_dir) in number:                # the next save goes after it
            accelerator.project_configuration.iteration = number[os.path.normpath(input_dir)] + 1
    return input_dir
