"""Overlap's side of the step envelope (`thinwire.optim.base`, whose docstring gives the
order): the previous step's exchange lands while this one's leaves, and a lookahead moves the
parameters by the rank's estimate of the update in flight until it lands."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .protocol import NonFiniteGradientError

if TYPE_CHECKING:
    from .checkpoints import InFlight


class OverlapSteps:
    """Mixed into `CommunicatingOptimizer`; uses its `_begin`, `_land` and `_resume`."""

    def _overlapped_step(self) -> None:
        """The previous step's exchange lands and this one's leaves. In that order by default;
        an algorithm with EARLY_START encodes and sends this step first, so the exchange in
        flight also overlaps the apply of the previous one (two briefly in flight)."""
        self._resume()
        self._take_back_lookahead()
        previous = self._inflight
        if previous is not None and max(self._step, previous.step) + 1 < self._landing_step(previous):
            self._local_step_in_flight(previous)
            return
        self._inflight = None
        if previous is None or not self.EARLY_START:
            try:
                if previous is not None:
                    self._land(previous)
            except NonFiniteGradientError:
                self._inflight = self._begin(self._step)   # every call is a step: only the flagged one is lost
                self._look_ahead()
                raise
            self._inflight = self._begin(self._step)
            self._look_ahead()
            return
        try:
            current = self._begin(previous.step)
        except BaseException:            # e.g. a peer mismatch, raised before this step changes any
            self._inflight = previous    # state: the previous exchange stays in flight for flush()
            raise
        try:
            self._land(previous)
        finally:
            self._inflight = current
            if current is not None:      # its absent parameters' snapshot: as the previous apply left them
                for m in current.layout:
                    if m.key in current.snapshot:
                        current.snapshot[m.key][0].copy_(m.param)
            self._look_ahead()

    def _local_step_in_flight(self, previous: InFlight) -> None:
        """A step before `previous` is due to land: a local step, its exchange left in flight."""
        self._step = max(self._step, previous.step)
        if self._begin(self._step) is not None:
            raise RuntimeError(f"{type(self).__name__} started an exchange at step {self._step} with the one "
                               f"of step {previous.step} still in flight: its delay exceeds its interval")

    def _look_ahead(self) -> None:
        """lookahead: the parameters moved by this rank's estimate of the update in flight, so
        the caller's next gradient is taken about where they will be when it lands (Psyche's
        correction of its one-step overlap). The exact ones are saved first and put back by
        `_take_back_lookahead` before the next finish."""
        if not self.lookahead or self._inflight is None:
            return
        step, layout, exchange = self._inflight.step, self._inflight.layout, self._inflight.exchange
        if [s.shape for s in self._saved] != [m.param.shape for m in layout]:
            self._saved = [torch.empty_like(m.param) for m in layout]
        torch._foreach_copy_(self._saved, [m.param for m in layout])       # one launch per dtype, not per tensor
        self._looked_ahead = layout
        self._estimate(step, layout, exchange)

    @torch.no_grad()
    def _take_back_lookahead(self) -> None:
        if self._looked_ahead is not None:
            torch._foreach_copy_([m.param for m in self._looked_ahead], self._saved)
            self._looked_ahead = None
