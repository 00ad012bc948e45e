"""The end of a training worker that a framework launched (torchrun): `end_worker()`.

A process that exits with its gloo group alive can abort after a run that succeeded
('terminate called without an active exception', SIGABRT): a gloo thread finishing a
collective takes the GIL to free its tensors while the interpreter finalizes, which Python
(before 3.14) answers with pthread_exit through a noexcept frame. Under torchrun that one
rank's abort fails the whole launch. `destroy_process_group()` alone does not prevent it
while anything still holds the group (an optimizer does), so the worker also skips the
interpreter's finalization, as thinwire's own workers do (`thinwire.train.launch.exit_process`).
"""

from __future__ import annotations

from typing import NoReturn

import torch.distributed as dist

from ..train.launch import exit_process


def end_worker(code: int = 0) -> NoReturn:
    """Destroy the default process group (when one is up) and end this process with `code`,
    skipping the interpreter's finalization: call it last, after every file is written and
    closed (atexit handlers do not run; stdout and stderr are flushed)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    exit_process(code)
