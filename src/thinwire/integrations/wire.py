"""Count every collective a process issues, whoever issues it: the check that a framework
sends no dense gradient beside a thinwire optimizer.

    counter = CollectiveCounter().attribute(optimizer)
    with counter:                      # on the thread that trains (a dispatch mode is per thread)
        trainer.train()
    counter.bytes("backward")          # 0 under keep_gradients_local; the gradients under plain DDP
    counter.bytes("optimizer") == optimizer.comm_stats.payload_bytes

Every torch.distributed collective reaches the dispatcher as a `c10d::` operator, whether
Python issued it (`dist.all_reduce`, `all_gather_object`) or C++ did (DDP's reducer in
backward, its start-up broadcast). `CollectiveCounter` is a `TorchDispatchMode` that tallies
each one by label and operator:
- "backward": issued while autograd runs a backward pass (DDP's gradient all-reduce), even
  inside a closure that `step(closure)` runs;
- "optimizer": otherwise, issued inside `step()` or `flush()` of an attributed optimizer;
- "other": everything else (start-up broadcasts, logging, checkpoint gathers, barriers).

Bytes are what this rank hands to the collective, the convention of `CommStats.payload_bytes`:
its input tensors; for a broadcast or scatter only on the source, for a receive or barrier none.
The mode sees every operator on its thread, so it slows a run: a check, not a profiler.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# operator -> the argument holding what this rank sends (None: it sends no payload)
SENT = {
    "allreduce_": "tensors", "allreduce_coalesced_": "tensors", "reduce_": "tensors", "send": "tensors",
    "broadcast_": "tensors", "allgather_": "input_tensors", "allgather_coalesced_": "input_list",
    "alltoall_": "input_tensors", "gather_": "input_tensors", "scatter_": "input_tensors",
    "reduce_scatter_": "input_tensors", "_allgather_base_": "input_tensor", "_reduce_scatter_base_": "input_tensor",
    "alltoall_base_": "input", "allgather_into_tensor_coalesced_": "inputs",
    "reduce_scatter_tensor_coalesced_": "inputs",
    "recv_": None, "recv_any_source_": None, "barrier": None, "monitored_barrier_": None,
}
ROOTED = {"broadcast_", "scatter_"}        # only the root sends
LABELS = ("optimizer", "backward", "other")


def _nbytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def sent_bytes(func, args: tuple, kwargs: dict) -> int:
    """Bytes this rank hands to the c10d operator `func` called with (args, kwargs)."""
    name = func._schema.name.split("::", 1)[1]
    arg = SENT.get(name)
    if arg is None:
        return 0
    bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    if name in ROOTED and dist.ProcessGroup.unbox(bound["process_group"]).rank() != bound["root_rank"]:
        return 0
    return _nbytes(bound[arg])


class CollectiveCounter(TorchDispatchMode):
    """Calls and bytes of every collective issued on this thread while entered, by label
    ("optimizer", "backward", "other") and operator (module docstring)."""

    def __init__(self):
        super().__init__()
        self.records: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # calls, bytes, largest
        self.optimizer_steps = 0
        self._inside_optimizer = 0

    def attribute(self, optimizer: torch.optim.Optimizer) -> "CollectiveCounter":
        """Label what `optimizer.step()` (and `flush()`, if it has one) issue "optimizer"; count
        its steps. Returns self."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"attribute takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        optimizer.register_step_pre_hook(lambda *_: self._enter_optimizer())
        optimizer.register_step_post_hook(lambda *_: self._leave_optimizer(step=True))
        if callable(getattr(optimizer, "flush", None)):
            optimizer.flush = self._labelled(optimizer.flush)
        return self

    def _enter_optimizer(self) -> None:
        self._inside_optimizer += 1

    def _leave_optimizer(self, step: bool = False) -> None:
        self._inside_optimizer -= 1
        self.optimizer_steps += step

    def _labelled(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self._enter_optimizer()
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave_optimizer()
        return wrapper

    def _label(self) -> str:
        # backward first: Lightning runs forward and backward in the closure it passes to step()
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "optimizer" if self._inside_optimizer else "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._schema.name.split("::", 1)[1] in SENT:
            nbytes = sent_bytes(func, args, kwargs)
            record = self.records[(self._label(), func._schema.name.split("::", 1)[1])]
            record[0] += 1
            record[1] += nbytes
            record[2] = max(record[2], nbytes)
        return func(*args, **kwargs)

    def calls(self, label: str | None = None) -> int:
        """Collectives issued under `label` (None: all)."""
        return sum(r[0] for (lab, _), r in self.records.items() if label in (None, lab))

    def bytes(self, label: str | None = None) -> int:
        """Bytes this rank handed to collectives under `label` (None: all)."""
        return sum(r[1] for (lab, _), r in self.records.items() if label in (None, lab))

    def largest(self, label: str | None = None) -> int:
        """The most bytes one collective under `label` carried (None: any)."""
        return max((r[2] for (lab, _), r in self.records.items() if label in (None, lab)), default=0)

    def summary(self) -> dict:
        """{"optimizer_steps", label: {operator: {"calls", "bytes", "largest"}}}: JSON-ready."""
        out: dict = {"optimizer_steps": self.optimizer_steps}
        for (label, op), (calls, nbytes, largest) in sorted(self.records.items()):
            out.setdefault(label, {})[op] = {"calls": calls, "bytes": nbytes, "largest": largest}
        return out
