"""The interpreter does not finalize while gloo's thread still holds a tensor thinwire handed it.

Why: on Python before 3.14 a thread that asks for the GIL while the interpreter finalizes is
ended by pthread_exit, which inside gloo's noexcept frames is std::terminate: `terminate called
without an active exception` (SIGABRT) in a process whose run had succeeded. gloo's worker
thread asks for it after every collective: torch keeps "a tensor whose C++ refcount is above 1
holds a reference to its Python object" (torch/csrc/utils/pyobject_preservation.cpp, torch >=
2.10; `Tensor._use_count()` counts those owners), so when that thread drops a finished work it
decrefs the Python object of every tensor the work held, whoever else still holds the tensor
(a persistent buffer does not spare it). It does so after it woke the waiting thread; on a
loaded machine the main thread can run through `destroy_process_group()` and into finalization
first. gloo's threads are alive then: `destroy_process_group()` does not join them while
anything holds the group, and importing torch._dynamo (every torch.optim step does) leaves
references to the default group.

What: every tensor the `Communicator` hands to torch.distributed is recorded with its C++ use
count before the call and a weak reference to the work; an atexit handler (atexit runs before
finalization starts) sleeps, releasing the GIL, until each recorded tensor whose work Python has
dropped is back at that count (gloo's thread has let go of it), or `LIMIT_S` passes (a
collective stuck on a dead peer). A work Python still holds (a step left in flight without
`flush()`) is skipped: the main thread frees it. Workers that end with `os._exit`
(`thinwire.integrations.end_worker`) never finalize and need none of this.
"""

from __future__ import annotations

import atexit
import time
import weakref

LIMIT_S = 10.0       # the longest exit waits for gloo's thread; only a stuck collective reaches it
_POLL_S = 0.001

_handed: list = []   # (weak reference to the work, [(tensor, C++ use count before the call)])
_registered = False


def _use_count(tensor) -> int:
    return tensor._use_count()


def _held(entry) -> bool:
    """gloo's thread (no Python object) still owns a tensor of this entry's work."""
    work, tensors = entry
    return work() is None and any(_use_count(t) > before for t, before in tensors)


def _done(entry) -> bool:
    work, tensors = entry
    return work() is None and not _held(entry)


def issue(tensors, collective, *args, **kwargs):
    """`collective(*args, **kwargs)` (a torch.distributed call with async_op=True), recording
    `tensors` (every tensor object it is given) for the exit wait; returns its work."""
    counts = [(t, _use_count(t)) for t in tensors] if hasattr(tensors[0], "_use_count") else None
    work = collective(*args, **kwargs)
    if counts is not None and work is not None:
        record(work, counts)
    return work


def record(work, counts) -> None:
    """Remember `work`'s tensors until gloo's thread has let go of them (see the module)."""
    global _registered
    _handed[:] = [entry for entry in _handed if not _done(entry)]   # kept short: at most those in flight
    try:
        _handed.append((weakref.ref(work), counts))
    except TypeError:                                # a work type without weak references: not guarded
        return
    if not _registered:
        atexit.register(wait_released)
        _registered = True


def wait_released(limit_s: float = LIMIT_S) -> bool:
    """Sleep (the GIL released) until no recorded tensor is held by gloo's thread alone, at most
    `limit_s`; True when none is."""
    deadline = time.monotonic() + limit_s
    while any(_held(entry) for entry in _handed):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True
