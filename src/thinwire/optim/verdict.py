"""nonfinite='skip' without a host read: each step's verdict is decided on the device and
read by the host a step later.

With 'raise' the host must read what every rank's message said before the step ends (it
raises NonFiniteGradientError in that very step, on every rank). With 'skip' nothing in the
step needs the answer on the host: an algorithm that can apply a step under a device flag
(`_applies_masked`) lands it with `skip`, a 0-dim bool computed from the prefixes (or the
trailer) and its own arrival checks, and no parameter or state moves where it is set. What
the host needs to name the cause (the headers, or the trailer's summary, and the arrival
flags: the evidence) is copied to host memory without waiting (pinned, `non_blocking`) and
judged at the start of the next `step()` or `flush()`, the same call on every rank, when
the device has long produced it:

    a non-finite step       counted in `skipped_steps` (the steps skipped so far)
    ranks out of lockstep   PeerMismatchError, as 'raise' would have raised a step earlier;
    or a malformed header   the step itself was not applied on any rank
    a malformed payload     ValueError naming the step; it was not applied on any rank

So a skip becomes visible to the caller at the next `step()`, `flush()` or read of
`skipped_steps`, and an error one call later than with nonfinite='raise'.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from ..compress.topk import MALFORMED

Judge = Callable[[list], tuple[list, list[bool]]]   # evidence values -> (flagged ranks, arrival flags)


class PendingVerdicts:
    """The evidence of steps applied under a device flag, waiting to be judged on the host.
    Host buffers are reused: once the first steps have run, a step allocates nothing."""

    def __init__(self):
        self._queue: deque = deque()                # (step, host evidence, event or None, judge)
        self._free: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []      # every host buffer made (they stay on the host)
        self.skipped: list[int] = []

    def push(self, step: int, evidence: torch.Tensor, judge: Judge) -> None:
        """Copy `evidence` to the host without waiting for the device."""
        host = self._buffer(evidence)
        host.copy_(evidence, non_blocking=True)
        event = None
        if evidence.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._queue.append((step, host, event, judge))

    def judge(self) -> None:
        """Judge every pending step, oldest first (waiting for its copy, long done in practice):
        count the skipped ones; raise the first error."""
        while self._queue:
            step, host, event, judge = self._queue.popleft()
            if event is not None and not event.query():     # query: no sync when (as usual) it is done
                event.synchronize()
            values = host.tolist()
            self._free.append(host)
            flagged, malformed = judge(values)
            if flagged:
                self.skipped.append(step)
            elif any(malformed):
                raise ValueError(f"{MALFORMED} at step {step}; that step was not applied on any rank")

    def pending_steps(self) -> set[int]:
        """The steps whose evidence waits to be judged."""
        return {step for step, *_ in self._queue}

    def clear(self) -> None:
        self._queue.clear()

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        for i, buf in enumerate(self._free):
            if buf.shape == like.shape and buf.dtype == like.dtype:
                return self._free.pop(i)
        buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
        self.buffers.append(buf)
        return buf
