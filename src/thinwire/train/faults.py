"""What the harness does to itself for tests and benchmarks, from environment variables.

    THINWIRE_DIE_AT="rank:step[:how]"      kill, stop or kill-in-save that rank at that step
    THINWIRE_STEP_SLEEP=SECONDS            sleep after every step (outside its timing)
    THINWIRE_SLOW_STEPS="P:FACTOR[:SEED]"  a slowed site: before a step, with probability P,
                                           sleep FACTOR x the last step's compute time
    THINWIRE_STEP_DIGEST=1                 every step record carries the parameters' SHA-256

None of them is read unless set; a run without them is the run the harness always ran.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time

import torch

from ..optim.shards import is_dtensor


def fault(rank: int, step: int) -> str | None:
    """Fault injection for tests: THINWIRE_DIE_AT="rank:step[:how]" names that rank's fault at
    that step: "kill" (the default: SIGKILL as it starts the step), "stop" (SIGSTOP there: a
    silent peer) or "save" (SIGKILL inside that step's checkpoint write, before its own shard
    is written: `die_in_save`); on a first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT
    unset or 0). None: no fault here."""
    spec = os.environ.get("THINWIRE_DIE_AT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    who, when, *how = spec.split(":")
    return (how or ["kill"])[0] if int(who) == rank and int(when) == step else None


def maybe_die(rank: int, step: int) -> None:
    how = fault(rank, step)
    if how in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def die_in_save(rank: int, step: int):
    """checkpoint.save's `before_write` hook for THINWIRE_DIE_AT="rank:step:save", else None."""
    if fault(rank, step) == "save":
        return lambda: os.kill(os.getpid(), signal.SIGKILL)
    return None


def pace() -> None:
    """Tests and benchmarks: THINWIRE_STEP_SLEEP=SECONDS sleeps after every step, outside its
    timing, so that tiny's millisecond steps leave time to kill or add a torchrun node mid-run."""
    pause = float(os.environ.get("THINWIRE_STEP_SLEEP") or 0)
    if pause > 0:
        time.sleep(pause)


def slow_before(step: int, last_step_s: float | None) -> float:
    """THINWIRE_SLOW_STEPS="P:FACTOR[:SEED]": before `step`, with probability P, sleep FACTOR
    times the last step's compute time (`last_step_s`: its wall time less its time blocked in
    the exchange, so a sleep does not grow with the waits it causes): a straggling site for the
    store exchange's runs. The draw is seeded by SEED and the step, so every worker of a command
    (a site) sleeps at the same steps and a rerun sleeps at them again. Returns the seconds
    slept (0 when not slowed)."""
    spec = os.environ.get("THINWIRE_SLOW_STEPS")
    if not spec or not last_step_s:
        return 0.0
    p, factor, *seed = spec.split(":")
    draw = random.Random(f"{seed[0] if seed else 0}:{step}").random()
    if draw >= float(p):
        return 0.0
    pause = float(factor) * last_step_s
    time.sleep(pause)
    return pause


def params_digest(model, whole: bool = True) -> str:
    """SHA-256 of the parameters, parameter by parameter in order, as raw bytes: two replicas
    have the same digest exactly when they are bit-identical. An FSDP2 shard counts as the whole
    tensor (one all-gather per parameter), or with `whole` False as this rank's shard (no
    collective: the same shard of two sites compares alike)."""
    digest = hashlib.sha256()
    for p in model.parameters():
        if is_dtensor(p):
            p = p.full_tensor() if whole else p.to_local()
        digest.update(p.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def step_digest(model) -> dict:
    """{'params_sha256': ...} for a step record under THINWIRE_STEP_DIGEST=1, else {}: under
    FSDP2 the logging rank's shards (no collective per step; the final record has the whole model's)."""
    if os.environ.get("THINWIRE_STEP_DIGEST") != "1":
        return {}
    return {"params_sha256": params_digest(model, whole=False)}
