"""What the framework tests share: start an example under torchrun with 2 gloo processes,
wait for it, read the collectives it counted, compare saved states."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.train.shared import Forked, start


def torchrun(example: Path, *args: str, env: dict) -> Forked:
    """`torchrun --standalone --nproc-per-node 2 example *args`, output captured. The agent is
    forked from the tests' server (tests.train.shared.start: torch already imported, ~3 s of
    CPU fewer a launch); it starts each worker as torchrun does, a new interpreter."""
    return start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(example), *args], env=env)


def finish(proc: Forked, ok: bool = True) -> str:
    """Wait for `proc`; assert it succeeded (`ok`) or failed (not `ok`, e.g. killed); its output."""
    text = proc.communicate(timeout=300)[0]
    assert (proc.returncode == 0) == ok, text[-3000:]
    return text


def read_wire(directory: Path, rank: int) -> dict:
    """What `--count` wrote for `rank`: the counter's summary and the optimizer's comm_stats."""
    return json.loads((directory / f"wire-rank{rank}.json").read_text())


def differs(a, b) -> bool:
    """Whether two saved states hold a tensor that differs (nested dicts and lists)."""
    if torch.is_tensor(a):
        return not torch.equal(a, b)
    if isinstance(a, dict):
        return any(differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return any(differs(x, y) for x, y in zip(a, b))
    return False
