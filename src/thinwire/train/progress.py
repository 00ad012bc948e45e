"""A dependency-free progress bar: one line per run, redrawn in place on a terminal and
printed every 10 % otherwise (so logs stay readable); `enabled=False` (--quiet) is silent."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, name: str, total: int, enabled: bool = True, stream=None):
        self.name, self.total, self.enabled = name, total, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start, self.val, self._last = time.perf_counter(), None, -1

    def update(self, step: int, loss: float, payload_bytes: int) -> None:
        if not self.enabled:
            return
        tenth = step * 10 // self.total
        if not self.tty and tenth == self._last and step != self.total:
            return
        self._last = tenth
        width = 24
        filled = width * step // self.total
        val = f" val {self.val:.3f}" if self.val is not None else ""
        line = (f"{self.name:>9} [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} "
                f"loss {loss:.3f}{val} sent {payload_bytes / 1e6:.2f} MB {time.perf_counter() - self.start:.0f}s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def note(self, val_loss: float) -> None:
        self.val = val_loss

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
