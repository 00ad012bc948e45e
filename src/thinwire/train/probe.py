"""Compute-only step times taken in the run's own processes: before training, after it, and at
its evaluations.

A run's ratio to dense AdamW's no-communication limit divides its time to target by AdamW's
steps to target × AdamW's compute-only s/step. Two things made that second factor drift on the
shared 2-core machine, and with it every ratio:
  * the first seconds of a process: DDP's calibration before training read 42.8 ms on rank 0
    where the same calibration after training read 34.3 ms (`wan`, seed 0; rank 1: 34.9 / 36.1);
  * the machine's speed from one run to the next, minutes apart: AdamW's calibrated step moved
    between 33 and 66 ms over a series of runs, while a run's own local steps took 33-36 ms.
So the harness times a compute-only step twice, before the first step and after the last, and
keeps the smaller median (`calibrate`): the step as fast as it runs here, which is what a limit
is. A DDP run calibrates its own step that way (`ddp.compute_only_step_s`, under no_sync()).
Every other single-tier run also times dense AdamW's step itself (`AdamWProbe`: forward,
backward and torch AdamW with the DDP baseline's hyperparameters, on a copy of the model; with
communication off DDP is its module), so `report.add_limits` can divide the run's time by
AdamW's steps × AdamW's step in the same processes, at the same time. The two ends did not
track a run either: its own local steps took 0.96-1.31x the step timed before and after it
(`wan`, seven runs). So that copy also times a few steps at every evaluation
(`AdamWProbe.sample`), and a ratio divides by their mean up to the run's target
(`step_during`). The mean, not the median: the samples come in spells (a slow spell slows all
three steps of an evaluation, and the run's own steps beside them), and the run's time is a
sum that pays those spells. On `wan` a run that never syncs (its step: AdamW's plus a
finiteness check; the median of its steps 1.034x the samples' median) took 1.052x
(475 steps x the samples' mean) against 1.091x (x their median) to its 475th step.

Neither touches the run: the DDP calibration restores parameters and optimizer state; the
AdamW probe works on a copy, and both run under a forked RNG, so a run with them is the run
without them, bit for bit (tested).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

# Timed steps without communication; the first is dropped. 21: on the shared 2-core machine the
# median of 5 moved between 0.031 and 0.045 s on `wan` from run to run (a +-18 % limit).
CALIBRATION_STEPS = 21

# AdamW steps timed at each evaluation after step 0 (`AdamWProbe.sample`): 3 x 24 evaluations on
# `wan` put 72 samples through the run for about 2.5 s of probing outside its timed steps.
SAMPLE_STEPS = 3

Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]   # calibration step i -> (x, y)
T = TypeVar("T")


def step_times(step: Callable[[torch.Tensor, torch.Tensor], None], batches: Batches, steps: int) -> list[float]:
    """Wall time of each of `steps` calls of `step(x, y)` on batches 0, 1, ..."""
    times = []
    for i in range(steps):
        x, y = batches(i)
        t0 = time.perf_counter()
        step(x, y)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def median_step_s(step: Callable[[torch.Tensor, torch.Tensor], None], batches: Batches,
                  steps: int = CALIBRATION_STEPS) -> float:
    """Median wall time of `step(x, y)` over `steps` calls (the first, a warm-up, dropped)."""
    times = step_times(step, batches, steps)
    return statistics.median(times[1:] if len(times) > 1 else times)


class AdamWProbe:
    """Dense AdamW's compute-only step on a copy of `model`, kept for the run: forward, backward
    and the step of `adamw(params)` (the DDP baseline's torch AdamW, `optimizers.torch_adamw`).
    `median_s` times a calibration (before and after training); `sample` times a few steps
    between two of the run's steps (at each evaluation), so the limit follows the machine's
    speed through the run. Both run under a forked RNG and touch nothing of the run."""

    def __init__(self, model: torch.nn.Module, adamw: Callable, batches: Batches):
        self.model, self.batches = model, batches
        self.replica = copy.deepcopy(model)
        for p in self.replica.parameters():
            p.grad = None
        self.optimizer = adamw(self.replica.parameters())

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(self.replica(x).flatten(0, 1), y.flatten()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def median_s(self, steps: int = CALIBRATION_STEPS) -> float:
        """Median s/step over `steps` steps, the first (a warm-up) dropped."""
        return without_rng(lambda: median_step_s(self._step, self.batches, steps), self.model)

    def sample(self, steps: int = SAMPLE_STEPS) -> list[float]:
        """The s of each of `steps` steps, none dropped (the run's own step after an evaluation
        is as cold as the first of these)."""
        return without_rng(lambda: step_times(self._step, self.batches, steps), self.model)


def samples_during(evals: list[dict], until_step: int | None) -> list[float]:
    """The AdamW steps sampled at the evaluations up to `until_step` (every one when None;
    `adamw_probe_s` of an eval record, worker.py)."""
    return [t for e in evals if until_step is None or e["step"] <= until_step for t in e.get("adamw_probe_s", ())]


def step_during(evals: list[dict], until_step: int | None) -> float | None:
    """The mean of `samples_during` (None when none was sampled): AdamW's expected step over the
    run's steps to target. A run's time is a sum over its steps, slow ones included, and the
    samples are spread evenly over those steps, so their mean scales the way that sum does;
    their median leaves out the machine's slow spells that the run's own time pays."""
    times = samples_during(evals, until_step)
    return statistics.fmean(times) if times else None


def without_rng(measure: Callable[[], T], model: torch.nn.Module) -> T:
    """measure() under a forked RNG (CPU, and the model's CUDA device if it has one)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    with torch.random.fork_rng(devices=devices):
        return measure()


def calibrate(before: float | None, after: float | None) -> dict:
    """The record of two timings of one step: both, and the smaller (None when not taken)."""
    taken = [t for t in (before, after) if t is not None]
    return {"before_s": before, "after_s": after, "step_s": min(taken) if taken else None}
