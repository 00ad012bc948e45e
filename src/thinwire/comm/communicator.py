"""Collectives on flat buffers over a torch.distributed process group, with byte accounting.

Every thinwire optimizer talks to its peers only through a `Communicator`, so the bytes it
records are the bytes actually handed to torch.distributed (`tensor.nbytes`), never an
estimate. With no initialised process group (or a world of one) every collective is a
local identity and moves nothing.

Every tensor handed to torch.distributed is recorded by `exit_guard`, so a normal exit waits
until gloo's thread has let go of it (the exit race of issue 46; see there).

Time blocked in torch.distributed can be observed, process-wide, without touching
torch.distributed itself: `Communicator.set_blocked_observer(fn)` (see there).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import exit_guard
from .links import link_bytes
from .stats import CommStats


# The blocked-time observer (Communicator.set_blocked_observer); None: nothing is timed.
_blocked_observer = None


class Pending:
    """An issued asynchronous collective; `wait()` returns its result tensor.

    `observer` (the blocked-time observer when the collective was issued, or None) is
    called with (`op`, seconds) once the first `wait()` on issued work returns. `absent`: the
    ranks whose rows a gather did not fill (none here; the store exchange's rounds may leave
    some out, `thinwire.store.communicator.RoundPending`)."""

    absent: tuple[int, ...] = ()

    def __init__(self, work, result: torch.Tensor | None, op: str = "", observer=None):
        self._work, self._result = work, result
        self._op, self._observer = op, observer

    def wait(self):
        if self._work is not None:
            if self._observer is None:
                self._work.wait()
            else:
                t = time.perf_counter()
                self._work.wait()
                self._observer(self._op, time.perf_counter() - t)
            self._work = None
        return self._result


class _Assemble:
    """Completes an all_to_all that kept the own part local: on wait, the W−1 rows that
    arrived go around the own row, into their source ranks' rows of the result."""

    def __init__(self, work, out: torch.Tensor, arrived: torch.Tensor, rank: int):
        self._work, self._out, self._arrived, self._rank = work, out, arrived, rank

    def wait(self):
        self._work.wait()
        r = self._rank
        self._out[:r].copy_(self._arrived[:r])
        self._out[r + 1:].copy_(self._arrived[r:])
        return True


def _all_gather_single():
    # torch >= 2.10 renamed all_gather_into_tensor; keep working on both.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Communicator:
    """Wraps a process group (default: the world group) and counts what crosses the wire."""

    WHOLE_MESSAGES = False          # a gather may be split in parts (`GatherAll`); the store's may not

    def __init__(self, process_group=None):
        self.stats = CommStats()
        if dist.is_available() and dist.is_initialized():
            self.group = process_group if process_group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        else:
            if process_group is not None:
                raise ValueError("process_group given but torch.distributed is not initialised")
            self.group, self.rank, self.world_size = None, 0, 1

    @staticmethod
    def set_blocked_observer(fn):
        """Observe the time this process blocks in torch.distributed; returns the previous
        observer (None: unset, the default).

        `fn(op, seconds)` is called, for every Communicator in the process, with the
        collective's name ('all_reduce', 'all_gather', 'all_to_all', 'gather', 'broadcast')
        and wall seconds blocked:

        - synchronous collective: once, when it has completed (from issuing to completion);
        - `async_op=True`: once when the call returns (the time spent issuing it), and once
          when the first `Pending.wait()` returns (the time spent waiting; for an all_to_all
          with `send_own=False` that includes placing the arrived rows).

        Collectives that call no torch.distributed (no process group, a world of one) are not
        reported. With no observer set no clock is read. Set `fn=None` to stop observing; a
        pending collective reports its wait to the observer set when it was issued.
        """
        global _blocked_observer
        previous, _blocked_observer = _blocked_observer, fn
        return previous

    @staticmethod
    def blocked_observer():
        """The observer `set_blocked_observer` set (None: unset): what an exchange that is not
        torch.distributed (the store's rounds, `thinwire.store.communicator`) reports its
        blocked time to, by the same rules, so a training loop times it alike."""
        return _blocked_observer

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def _record(self, op: str, tag: str, nbytes: int, payload: int, is_root: bool = False) -> None:
        sent, received = link_bytes(op, nbytes, self.world_size, is_root=is_root)
        self.stats.record(tag, payload, sent, received)

    @staticmethod
    def _flat(buf: torch.Tensor, name: str = "buf") -> torch.Tensor:
        if buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(buf.shape)}")
        return buf

    def all_reduce(self, buf: torch.Tensor, *, op: str = "sum", tag: str = "payload", async_op: bool = False):
        """In-place reduction of `buf` over ranks (`op`: 'sum' or 'max'); returns `buf`."""
        self._flat(buf)
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"op must be one of {tuple(ops)}, got {op!r}")
        self._record("all_reduce", tag, buf.nbytes, buf.nbytes)
        if not self.distributed:
            return self._finish(None, buf, async_op)
        start = _clock()
        work = exit_guard.issue([buf], dist.all_reduce, buf, op=ops[op], group=self.group, async_op=True)
        return self._finish(work, buf, async_op, "all_reduce", start)

    def all_gather(self, buf: torch.Tensor, *, tag: str = "payload", out: torch.Tensor | None = None,
                   async_op: bool = False):
        """Every rank's `buf`, stacked in rank order: shape [world_size, buf.numel()]."""
        self._flat(buf)
        shape = (self.world_size, buf.numel())
        if out is None:
            out = torch.empty(shape, dtype=buf.dtype, device=buf.device)
        elif tuple(out.shape) != shape or out.dtype != buf.dtype:
            raise ValueError(f"out must have shape {shape} and dtype {buf.dtype}")
        self._record("all_gather", tag, buf.nbytes, buf.nbytes)
        if not self.distributed:
            out[0].copy_(buf)
            return self._finish(None, out, async_op)
        start = _clock()
        flat = out.view(-1)
        work = exit_guard.issue([flat, buf], _all_gather_single(), flat, buf, group=self.group, async_op=True)
        return self._finish(work, out, async_op, "all_gather", start)

    def all_to_all(self, buf: torch.Tensor, *, tag: str = "payload", send_own: bool = True, async_op: bool = False):
        """Split `buf` into world_size equal parts; part j goes to rank j. Returns what arrived,
        as [world_size, part] in source-rank order.

        send_own=False keeps this rank's own part out of the collective (a zero-size split;
        the row comes back by a local copy), so only the W−1 parts bound for peers are handed
        to torch.distributed and counted as payload; link bytes are the same either way."""
        self._flat(buf)
        if buf.numel() % self.world_size:
            raise ValueError(f"buf length {buf.numel()} is not a multiple of world size {self.world_size}")
        parts = buf.view(self.world_size, -1)
        if not send_own:
            return self._all_to_all_peers(parts, tag, async_op)
        out = torch.empty_like(parts)
        self._record("all_to_all", tag, buf.nbytes, buf.nbytes)
        if not self.distributed:
            out.copy_(parts)
            return self._finish(None, out, async_op)
        start = _clock()
        flat = out.view(-1)
        work = exit_guard.issue([flat, buf], dist.all_to_all_single, flat, buf, group=self.group, async_op=True)
        return self._finish(work, out, async_op, "all_to_all", start)

    def _all_to_all_peers(self, parts: torch.Tensor, tag: str, async_op: bool):
        """all_to_all of parts [W, part] with the own row kept local (a zero split)."""
        r = self.rank
        out = torch.empty_like(parts)
        out[r].copy_(parts[r])
        others = torch.cat([parts[:r], parts[r + 1:]])                     # [W - 1, part]
        self._record("all_to_all", tag, parts.nbytes, others.nbytes)
        if not self.distributed:
            return self._finish(None, out, async_op)
        splits = [0 if j == r else parts.shape[1] for j in range(self.world_size)]
        arrived = torch.empty_like(others)
        start = _clock()
        received, sent = arrived.view(-1), others.view(-1)
        work = exit_guard.issue([received, sent], dist.all_to_all_single, received, sent, splits, splits,
                                group=self.group, async_op=True)
        return self._finish(_Assemble(work, out, arrived, r), out, async_op, "all_to_all", start)

    def gather(self, buf: torch.Tensor, *, dst: int = 0, tag: str = "payload", async_op: bool = False):
        """Every rank's `buf` at rank `dst` as [world_size, numel]; None on other ranks."""
        self._flat(buf)
        self._check_rank(dst, "dst")
        root = self.rank == dst
        self._record("gather", tag, buf.nbytes, buf.nbytes, is_root=root)
        out = torch.empty(self.world_size, buf.numel(), dtype=buf.dtype, device=buf.device) if root else None
        if not self.distributed:
            out[0].copy_(buf)
            return self._finish(None, out, async_op)
        parts = list(out.unbind(0)) if root else None
        dst = self._global(dst)
        start = _clock()
        work = exit_guard.issue([buf, *(parts or [])], dist.gather, buf, parts, dst=dst, group=self.group,
                                async_op=True)
        return self._finish(work, out, async_op, "gather", start)

    def broadcast(self, buf: torch.Tensor, *, src: int = 0, tag: str = "payload", async_op: bool = False):
        """In-place: every rank's `buf` becomes rank `src`'s. Returns `buf`."""
        self._flat(buf)
        self._check_rank(src, "src")
        root = self.rank == src
        self._record("broadcast", tag, buf.nbytes, buf.nbytes if root else 0, is_root=root)
        if not self.distributed:
            return self._finish(None, buf, async_op)
        src = self._global(src)
        start = _clock()
        work = exit_guard.issue([buf], dist.broadcast, buf, src=src, group=self.group, async_op=True)
        return self._finish(work, buf, async_op, "broadcast", start)

    def _check_rank(self, rank: int, name: str) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{name} must be a rank in 0..{self.world_size - 1}, got {rank}")

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    @staticmethod
    def _finish(work, result, async_op: bool, op: str = "", start: float | None = None):
        """Wait for `work` unless `async_op`; report blocked time from `start` (see
        set_blocked_observer; None: not timed)."""
        observer = _blocked_observer if start is not None else None
        if async_op:
            if observer is not None:
                observer(op, time.perf_counter() - start)
            return Pending(work, result, op, observer)
        if work is not None:
            work.wait()
        if observer is not None:
            observer(op, time.perf_counter() - start)
        return result


def _clock() -> float | None:
    """Now, if a blocked-time observer is set (else None: nothing is timed)."""
    return time.perf_counter() if _blocked_observer is not None else None
