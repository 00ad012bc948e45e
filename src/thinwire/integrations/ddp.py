"""DDP without its gradient all-reduce: the optimizer communicates, DDP does not.

    ddp = DistributedDataParallel(model, broadcast_buffers=False)   # or the framework's wrapper
    keep_gradients_local(ddp)                # backward leaves each rank's own gradient in .grad

DDP all-reduces gradient buckets from inside backward through its communication hook
(`register_comm_hook`). `local_gradients_hook` is a hook that returns the bucket as it is:
no collective, no division by the world size, so `p.grad` is exactly this rank's gradient,
which is what a thinwire optimizer expects. DDP's other traffic is not gradients: it
broadcasts the parameters once when it wraps the model (replicas start equal, which thinwire
requires anyway) and, unless `broadcast_buffers=False`, the module's buffers before every
forward; `keep_gradients_local` refuses a DDP that would still do the latter (or, asked to,
switches it off), and one built with `find_unused_parameters=True`, which all-reduces its
used-parameter map in backward.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def local_gradients_hook(state, bucket):      # no annotations: DDP inspects them
    """A DDP communication hook that communicates nothing: the bucket's local gradients."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def keep_gradients_local(model: torch.nn.Module, stop_buffer_sync: bool = False) -> torch.nn.Module:
    """Register `local_gradients_hook` on `model` (a DistributedDataParallel) and return it.
    ValueError for anything else, for a DDP that looks for unused parameters (it all-reduces
    its used-parameter map in backward), and for one that broadcasts its buffers every forward
    unless `stop_buffer_sync`, which switches that broadcast off instead (by the attribute's
    current name, `forward_sync_buffers`, where torch has it): for frameworks whose DDP settings
    only pass the deprecated `broadcast_buffers`, which torch >= 2.13 warns about."""
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"keep_gradients_local takes a DistributedDataParallel, got {type(model).__name__}: "
                         f"a model that no framework wrapped in DDP needs nothing")
    if getattr(model, "find_unused_parameters", False):
        raise ValueError("this DDP was built with find_unused_parameters=True: it all-reduces its used-parameter "
                         "map in backward; build it with find_unused_parameters=False (Trainer: "
                         "ddp_find_unused_parameters=False; Accelerate: DistributedDataParallelKwargs("
                         "find_unused_parameters=False), its default; Lightning: DDPStrategy's default)")
    # newer torch keeps it as forward_sync_buffers (broadcast_buffers is its deprecated spelling)
    name = "forward_sync_buffers" if hasattr(model, "forward_sync_buffers") else "broadcast_buffers"
    if stop_buffer_sync:
        setattr(model, name, False)                 # read before every forward, not only at construction
    if getattr(model, name, True) and any(True for _ in model.module.buffers()):
        raise ValueError("this DDP broadcasts the model's buffers before every forward: build it with "
                         "broadcast_buffers=False or forward_sync_buffers=False (Trainer: ddp_broadcast_buffers=False; Accelerate: "
                         "DistributedDataParallelKwargs(broadcast_buffers=False); Lightning: "
                         "DDPStrategy(broadcast_buffers=False)), or pass stop_buffer_sync=True")
    model.register_comm_hook(None, local_gradients_hook)
    return model
