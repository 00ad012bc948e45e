"""What an exchange delivers (`Delivery`), the contract every exchange keeps (`Exchange`), and
the buffer helpers they share (`thinwire.optim.exchange`, `thinwire.optim.relay`)."""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from .protocol import Presence, prefix_nbytes, read_presence


class Delivery:
    """What an exchange delivered. `present.tolist()[i]`: layout parameter i had a gradient on
    some rank (`protocol.Presence`: read from the device only when this rank lacked one);
    `data`: the exchange's result, read by the algorithm's apply.

    What the prefixes (or the trailer) say stays on the device until `check(extra)` reads it,
    once per step, together with the algorithm's own device flags `extra` (the arrival checks
    of what it decoded, `thinwire.wire.checks`): that raises PeerMismatchError for ranks out of
    lockstep or a malformed header, sets `flagged` (the ranks whose gradients were not finite,
    empty on a good step) and returns the values of `extra`. `flagged` read before `check`
    makes it with no extra flags.

    The store exchange (`thinwire.store.StoreGroup`) may deliver fewer rows than ranks: `rows`
    names the ranks whose rows `data` holds (None: every rank, in rank order), and
    `excluded_self` is True when this rank's own message is not among them (the round's
    manifest left it out: it must keep it, `_keep_own`)."""

    def __init__(self, verdict: Callable[[list], tuple[list, list[bool]]], present: Presence, data,
                 defer: Callable | None = None, rows: list[int] | None = None, excluded_self: bool = False):
        self._verdict, self.present, self.data, self._defer = verdict, present, data, defer
        self.rows, self.excluded_self = rows, excluded_self
        self.own_flagged = False          # excluded_self: this rank's own message carried the non-finite flag
        self._flagged: list | None = None

    @property
    def deferrable(self) -> bool:
        return self._defer is not None

    def defer(self, extra: list[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor, Callable]:
        """Instead of `check`, for nonfinite='skip' (`thinwire.optim.verdict`): (skip, a 0-dim
        bool on the device; the evidence the host judges later, on the device; the judge of
        its values -> (flagged ranks, values of `extra`))."""
        return self._defer(list(extra))

    def check(self, extra: list[torch.Tensor] = ()) -> list[bool]:
        self._flagged, values = self._verdict(list(extra))
        return values

    @property
    def flagged(self) -> list:
        if self._flagged is None:
            self.check()
        return self._flagged


def read_now(flagged: list):
    """A verdict already made on the host (an exchange that had to read before delivering):
    only the extra flags are left to read."""
    return lambda extra: (flagged, [bool(v) for v in torch.stack(extra).tolist()] if extra else [])


@runtime_checkable
class Exchange(Protocol):
    """One step's messages: the algorithm writes `payload` (sized by the exchange's own
    `resize`, whose arguments differ per exchange), the envelope `seal`s the prefix, `start`s
    the first collective and `finish`es it into a `Delivery`."""

    @property
    def payload(self) -> torch.Tensor: ...

    def seal(self, step: int, flags: int, present: list[bool], nonfinite: torch.Tensor | None = None) -> None:
        """The prefix of this step; `nonfinite` (a 0-dim bool on the device) sets the flag
        without a host read (`PrefixWriter`)."""

    def start(self) -> None: ...

    def finish(self, step: int) -> Delivery: ...

    def checkpoint(self) -> list[torch.Tensor]: ...

    def resume(self, saved: list[torch.Tensor]) -> None: ...


def put_back(buffers: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    """Copy a checkpointed step in flight into this exchange's buffers, which must match it."""
    if [tuple(b.shape) for b in buffers] != [tuple(t.shape) for t in saved]:
        raise ValueError(f"the checkpoint's step in flight holds buffers of {[tuple(t.shape) for t in saved]} "
                         f"elements; this optimizer's layout has {[tuple(b.shape) for b in buffers]}")
    for b, t in zip(buffers, saved):
        b.copy_(t)


def presence_bits(message: torch.Tensor, n_params: int) -> list[bool]:
    """This rank's presence as a checkpointed message's prefix holds it (a resumed step's)."""
    return read_presence(message[None, :prefix_nbytes(n_params)], n_params).tolist()
