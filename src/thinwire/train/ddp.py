"""Dense AdamW / Adam as users run them: torch DDP, bucketed all-reduce overlapped with backward.

    ddp, stats = ddp_dense(model)                    # DDP(model), every bucket's bytes counted
    seconds = compute_only_step_s(built, batches)    # compute-only s/step, communication off

DDP all-reduces each gradient bucket (25 MB by default) as soon as backward has produced
it, on gloo's own thread, and waits for all of them at the end of backward: the exchange
overlaps backward's remaining compute. The harness keeps DDP's default bucketing and its
all-reduce, and only counts: `count_hook` is the default all-reduce hook (divide the
bucket by the world size, `all_reduce(async_op=True)`, return its future) with one line
added, which records the bucket buffer's real `nbytes` in a CommStats (the link formulas
of thinwire.comm.links). It never waits on the future: waiting in the hook would make
every bucket's all-reduce block backward and kill the overlap. The loop calls
`stats.begin_step()` before each backward (Built.counts_itself is False).

Compute-only time. DDP's wait for its all-reduces happens inside the autograd engine, so
the loop cannot time it apart (timing.BLOCKED stays 0 for DDP runs). `compute_only_step_s`
measures it directly instead: a few steps under `ddp.no_sync()` (no all-reduce is issued:
forward, backward and the optimizer step are all that runs), timed one by one; the first is
a warm-up and dropped, the median of the rest is the compute-only s/step. The worker takes it
before training and after (`probe.py`: the smaller is the run's). The model's parameters and
the optimizer's state are saved before and restored after (gradients reset to None), under a
forked RNG, so the run is exactly the run without calibration (tested).
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..comm import CommStats, link_bytes
from .probe import CALIBRATION_STEPS, Batches, median_step_s, without_rng


class _HookState:
    def __init__(self, stats: CommStats, process_group=None):
        self.stats, self.group, self.lock = stats, process_group, threading.Lock()


def count_hook(state, bucket):        # no annotations: DDP checks them, and they are strings here
    """torch's default all-reduce comm hook, counting the bucket's real bytes; never waits."""
    buffer = bucket.buffer()
    world = dist.get_world_size(state.group)
    sent, received = link_bytes("all_reduce", buffer.nbytes, world)
    with state.lock:
        state.stats.record("ddp_all_reduce", buffer.nbytes, sent, received)
    buffer.div_(world)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def ddp_dense(model: torch.nn.Module, process_group=None) -> tuple[DistributedDataParallel, CommStats]:
    """DDP(model) with DDP's default buckets and all-reduce, each bucket's bytes counted."""
    stats = CommStats()
    ddp = DistributedDataParallel(model, process_group=process_group)
    ddp.register_comm_hook(_HookState(stats, process_group), count_hook)
    return ddp, stats


def compute_only_step_s(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, batches: Batches,
                        steps: int = CALIBRATION_STEPS) -> float:
    """Median wall time of a training step with communication off (see the module docstring).
    `batches(i)` -> (x, y) of calibration step i. Parameters, optimizer state and RNG restored."""
    module = ddp.module
    saved_params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    saved_opt = copy.deepcopy(optimizer.state_dict())

    def step(x, y):
        with ddp.no_sync():
            F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    seconds = without_rng(lambda: median_step_s(step, batches, steps), module)
    with torch.no_grad():
        module.load_state_dict(saved_params)
    optimizer.load_state_dict(saved_opt)
    optimizer.zero_grad(set_to_none=True)
    return seconds
