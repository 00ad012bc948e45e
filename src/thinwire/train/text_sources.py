"""What the data modules share below both (train/data.py loads, train/corpus.py prepares):
which documents are validation, the embedded corpus's files, the token-id check."""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import torch

VAL_EVERY = 20          # text: file i is validation when i % VAL_EVERY == VAL_EVERY - 1
BIN_VAL_FRAC = 0.05


SKIPPED_DIRS = ("site-packages", "test", "tests")


def stdlib_files() -> list[Path]:
    """The standard library's .py files outside site-packages and test folders, in sorted
    order. The folders are pruned during the walk, not filtered after it: an interpreter's
    site-packages can hold ten times the stdlib's files (1 s a call, where this takes 0.02 s);
    and the list is made once per process."""
    return list(_stdlib_files(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=None)
def _stdlib_files(stdlib: str) -> tuple[Path, ...]:
    keep = []
    for folder, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        keep += [Path(folder, f) for f in files if f.endswith(".py")]
    return tuple(sorted(keep))


def check_ids(ids: torch.Tensor, vocab_size: int, path) -> None:
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"{path} holds token id {int(ids.max())} >= vocab_size {vocab_size}; "
                         f"pass --vocab-size {int(ids.max()) + 1} or more")
