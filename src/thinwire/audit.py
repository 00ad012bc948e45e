"""Count what a piece of torch code would cost a GPU, on any device: kernel launches, host
reads (the host waiting for the device), tensors built from host data, and collectives.

    audit = StepAudit()
    with audit:                        # on the thread that runs the step (a dispatch mode is per thread)
        optimizer.step()
    audit.launches, audit.host_reads   # totals; audit.summary() by operator

A GPU step costs what the host spends issuing it: each aten operator that computes launches
(at least) one kernel, and each operator whose result the host needs before it can go on
(`.item()`, `bool(t)`, `nonzero`, a boolean-mask index, `tolist()`) stalls the host until the
device has drained every queued kernel. On a CPU both are nearly free, so code tuned there
can cost a GPU thousands of launches and hundreds of stalls per step. `StepAudit` is a
`TorchDispatchMode`: it sees every aten operator below autograd, on CPU tensors as on CUDA
ones, so the counts it gives on CPU are the counts a GPU would see for the same code.

What counts as what (`classify`):
- a **launch**: every operator that computes, one per call (a `_foreach_*` call is one, as
  CUDA's multi-tensor apply launches one per ~100 tensors, unless its lists mix dtypes or
  devices; a `cat` is one unless its inputs and output mix dtypes: then torch loops, one
  per tensor, `foreach_launches`); views, metadata and allocations (`empty*`) are not;
- a **host read**: an operator whose result lands on the host (a Python scalar: `item`,
  `equal`, `is_nonzero`), one whose output size depends on the data (`nonzero`,
  `masked_select`, `unique`, a boolean-mask `index`, `repeat_interleave` without an output
  size), a copy from a device to the CPU, and `Tensor.tolist()` / `Tensor.numpy()` (which
  read memory without dispatching; patched while the audit is entered);
- a **host value**: a tensor made from Python data (`torch.tensor([...])`, `lift_fresh`): on
  a GPU a host-to-device copy every time the code runs;
- a **collective**: a `c10d` operator (its wire time is the link's, not the launch's).
A real GPU adds what the dispatcher does not show (the caching allocator, NCCL's own
kernels, multi-tensor apply's chunking); the profiler in benchmarks/gpu_step.py shows those.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# operators that compute nothing a kernel would run for: allocation and metadata
NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "set_", "resize_",
    "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "record_stream", "_reshape_alias",
    "_has_compatible_shallow_copy_type", "is_pinned", "dim", "size", "stride", "numel",
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit",   # profiler marks
    "scalar_tensor",        # a Python number wrapped for an operator (`torch.where(m, x, 0.0)`): a host value
}
# operators whose output size depends on the values: the host must read them to allocate it
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                  "argwhere", "nonzero_numpy"}
HOST_VALUE = {"lift_fresh", "lift_fresh_copy"}
KINDS = ("launch", "host_read", "host_value", "collective", "free")


def _name(func) -> str:
    return func._schema.name.split("::", 1)[1]


def _returns_host_scalar(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(not isinstance(r.type, torch.TensorType) and "Tensor" not in str(r.type)
                                 for r in returns)


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in indices or [])


def _on_host(value, host: frozenset) -> bool:
    """`value` (a tensor or a list of them) is among the tensors that stay on the host."""
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return bool(tensors) and all(torch.is_tensor(t) and t.untyped_storage().data_ptr() in host for t in tensors)


def _device_of(value) -> torch.device | None:
    return value.device if torch.is_tensor(value) else None


def _crosses_to_host(name: str, args, kwargs) -> bool:
    """A copy whose source lives on a device and whose result lands on the CPU."""
    if name == "_to_copy":
        src, dst = _device_of(args[0]), kwargs.get("device")
    elif name == "copy_":
        if (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
            return False                         # into pinned memory, waited for by an event later
        dst, src = _device_of(args[0]), _device_of(args[1])
    else:
        return False
    return src is not None and dst is not None and src.type != "cpu" and torch.device(dst).type == "cpu"


def classify(func, args: tuple, kwargs: dict, host: frozenset = frozenset()) -> str:
    """One of KINDS for the aten/c10d operator `func` called with (args, kwargs). `host`: the
    storages (`data_ptr`s) of tensors that live on the host even in a GPU run (torch
    optimizers' step counters): reading them costs the device nothing, computing on them
    launches nothing."""
    if func.namespace == "c10d":
        return "collective"
    name = _name(func)
    if name in HOST_VALUE:
        return "host_value"
    if func.is_view or name in NO_KERNEL:
        return "free"
    if host and args and _on_host(args[0], host):
        # a copy into host memory from the device is a launch (an asynchronous copy); work on host values is free
        return "launch" if name == "copy_" and len(args) > 1 and not _on_host(args[1], host) else "free"
    if (name in DATA_DEPENDENT or _returns_host_scalar(func) or _crosses_to_host(name, args, kwargs)
            or (name in ("index", "index_put", "index_put_") and _bool_index(args))
            or (name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4)):
        return "host_read"
    return "launch"


def foreach_launches(name: str, args: tuple, kwargs: dict | None = None) -> int:
    """Launches of one call: 1, except a `_foreach_*` call whose tensor lists mix dtypes or
    devices, which CUDA's multi-tensor apply cannot take, and a `cat` whose inputs are not
    all of its output's dtype, which CUDA's batched copy cannot take: torch runs them as a
    loop over the tensors (one launch each), where the dispatcher still shows one call."""
    if name == "cat":
        inputs, out = args[0], (kwargs or {}).get("out")
        dtypes = {t.dtype for t in inputs} | ({out.dtype} if out is not None else set())
        return len(inputs) if len(dtypes) > 1 else 1
    if not name.startswith("_foreach_"):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and all(torch.is_tensor(t) for t in a)]
    kinds = {(t.dtype, t.device) for tensors in lists for t in tensors}
    return max(len(t) for t in lists) if len(kinds) > 1 else 1


class StepAudit(TorchDispatchMode):
    """Counts, by kind and operator, what the code run while it is entered would cost a GPU
    (module docstring). Re-entering adds to the counts; `reset()` clears them."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.host = frozenset(t.untyped_storage().data_ptr() for t in host_tensors)
        self.counts: dict[str, Counter] = {kind: Counter() for kind in KINDS}
        self._patched: dict[str, object] = {}

    @staticmethod
    def host_steps(optimizer) -> list[torch.Tensor]:
        """The step counters that torch optimizers (`optimizer`, and those it wraps as
        `.optimizers` or `.inner`) keep on the CPU: on a GPU they stay there (unless
        capturable or fused), so their reads are host work, not device syncs; and a thinwire
        optimizer's host copies of its deferred verdicts (`thinwire.optim.verdict`)."""
        found, todo = list(getattr(getattr(optimizer, "_verdicts", None), "buffers", [])), [optimizer]
        while todo:
            opt = todo.pop()
            todo += list(getattr(opt, "optimizers", None) or [])
            if isinstance(getattr(opt, "inner", None), torch.optim.Optimizer):
                todo.append(opt.inner)
            for state in getattr(opt, "state", {}).values():
                step = state.get("step") if isinstance(state, dict) else None
                if torch.is_tensor(step) and step.dim() == 0 and step.device.type == "cpu":
                    found.append(step)
        return found

    def reset(self) -> None:
        for counter in self.counts.values():
            counter.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, name = classify(func, args, kwargs, self.host), _name(func)
        self.counts[kind][name] += foreach_launches(name, args, kwargs) if kind == "launch" else 1
        return func(*args, **kwargs)

    def __enter__(self):
        for method in ("tolist", "numpy"):               # they read memory without dispatching
            original = getattr(torch.Tensor, method)
            self._patched[method] = original
            setattr(torch.Tensor, method, self._reading(method, original))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for method, original in self._patched.items():
                setattr(torch.Tensor, method, original)
            self._patched.clear()

    def _reading(self, method: str, original):
        def read(tensor, *args, **kwargs):
            if not _on_host(tensor, self.host):      # a tensor that lives on the host reads no device
                self.counts["host_read"][f"Tensor.{method}"] += 1
            return original(tensor, *args, **kwargs)
        return read

    def total(self, kind: str) -> int:
        """Calls counted as `kind` (one of KINDS)."""
        return sum(self.counts[kind].values())

    launches = property(lambda self: self.total("launch"))
    host_reads = property(lambda self: self.total("host_read"))
    host_values = property(lambda self: self.total("host_value"))
    collectives = property(lambda self: self.total("collective"))

    def summary(self, top: int = 12) -> dict:
        """{"launches", "host_reads", "host_values", "collectives", kind: {operator: calls}}
        with each kind's `top` most frequent operators: JSON-ready."""
        out: dict = {"launches": self.launches, "host_reads": self.host_reads, "host_values": self.host_values,
                     "collectives": self.collectives}
        for kind in ("launch", "host_read", "host_value", "collective"):
            out[kind] = dict(self.counts[kind].most_common(top))
        return out
