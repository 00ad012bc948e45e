"""How one step's messages cross the wire: the exchanges the step envelope drives.

An exchange is started and finished by two separate calls, so the envelope can leave it
running (`start()` issues the first collective asynchronously; `finish()` waits, runs any
further phases and returns a `Delivery`). Each owns its send buffer, reused across steps;
the algorithm writes its payload after the prefix, the envelope seals the prefix.

    GatherAll     a uint8 message all-gathered: one all_gather, or up to four for a large one
                  (DeMo, EF21-Muon replicated, lossy syncs)
    ReduceAll     one all_reduce of a float buffer with a float trailer (dense baselines,
                  APMSqueeze's warmup, fp32 parameter-delta syncs)
    OneBitReduce  APMSqueeze's 1-bit all_to_all + all_gather (`thinwire.comm.collectives`)
    ServerRelay   gather to rank 0, a server step there, broadcast of its answer (EF21-Muon)

Every exchange keeps the `Exchange` contract below. A step in flight is checkpointed by
`checkpoint()` (copies of what `start()` sent from; ReduceAll, whose all_reduce overwrites
its message with the sum, waits for it and keeps the sum) and, sized by `resize` again in a
fresh optimizer, `resume(saved)` puts that back and starts the exchange as it was, so it
delivers what the interrupted one would have.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from ..comm import Communicator, Pending
from ..comm.collectives import OneBitAllReduce
from .protocol import (FLAG_NONFINITE, HEADER_NBYTES, LOCKSTEP_SLOTS, PeerMismatchError, PrefixWriter, Presence,
                       TrailerWriter, all_finite, header_evidence, headers_skip, judge_headers, judge_trailer,
                       prefix_nbytes, read_headers, read_presence, read_verdict, trailer_evidence, trailer_numel,
                       trailer_skip, write_prefix)

FLAG_SERVER_ERROR = 2          # a relayed answer's flag: the server rejected this step's messages

# A GatherAll message leaves as one all_gather per PART_BYTES started, at most MAX_PARTS, all in
# flight at once. Over an emulated 10 Mbit/s link (2 ranks, 129 KB each, 150 ms apart) one
# all_gather took 0.100 s median but 0.109-0.114 s mean and up to 0.184 s; four took 0.100-0.102 s
# mean and at most 0.115 s (benchmarks/link_exchange.py --gap 0.15 --max-parts 1 4).
PART_BYTES = 32 * 1024
MAX_PARTS = 4


class Delivery:
    """What an exchange delivered. `present.tolist()[i]`: layout parameter i had a gradient on
    some rank (`protocol.Presence`: read from the device only when this rank lacked one);
    `data`: the exchange's result, read by the algorithm's apply.

    What the prefixes (or the trailer) say stays on the device until `check(extra)` reads it,
    once per step, together with the algorithm's own device flags `extra` (the arrival checks
    of what it decoded, `thinwire.wire.checks`): that raises PeerMismatchError for ranks out of
    lockstep or a malformed header, sets `flagged` (the ranks whose gradients were not finite,
    empty on a good step) and returns the values of `extra`. `flagged` read before `check`
    makes it with no extra flags."""

    def __init__(self, verdict: Callable[[list], tuple[list, list[bool]]], present: Presence, data,
                 defer: Callable | None = None):
        self._verdict, self.present, self.data, self._defer = verdict, present, data, defer
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


def _read_now(flagged: list):
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


def _put_back(buffers: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    """Copy a checkpointed step in flight into this exchange's buffers, which must match it."""
    if [tuple(b.shape) for b in buffers] != [tuple(t.shape) for t in saved]:
        raise ValueError(f"the checkpoint's step in flight holds buffers of {[tuple(t.shape) for t in saved]} "
                         f"elements; this optimizer's layout has {[tuple(b.shape) for b in buffers]}")
    for b, t in zip(buffers, saved):
        b.copy_(t)


def _reuse(buf: torch.Tensor | None, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != torch.device(device):
        buf = torch.empty(numel, dtype=dtype, device=device)
    return buf


def _presence_bits(message: torch.Tensor, n_params: int) -> list[bool]:
    """This rank's presence as a checkpointed message's prefix holds it (a resumed step's)."""
    return read_presence(message[None, :prefix_nbytes(n_params)], n_params).tolist()


def gather_parts(nbytes: int) -> list[slice]:
    """The byte ranges of a message that `GatherAll` gathers in separate all_gathers, all in
    flight at once: one per PART_BYTES started, at most MAX_PARTS, equal but for the last."""
    count = max(1, min(MAX_PARTS, -(-nbytes // PART_BYTES)))
    size = -(-nbytes // count) if nbytes else 0
    return [slice(i * size, min(nbytes, (i + 1) * size)) for i in range(count)]


class GatherAll:
    """[prefix | payload] uint8 gathered from every rank (`gather_parts`: one all_gather, or a
    few for a large message); data: every rank's payload, [world, nbytes]."""

    def __init__(self, comm: Communicator, tag: str = "payload"):
        self.comm, self.tag, self.buffer, self.n_params = comm, tag, None, 0
        self._pending: list = []
        self._prefix, self._present = PrefixWriter(), []
        self._received: list[torch.Tensor] = []       # each part's [world, part bytes], reused
        self._gathered: torch.Tensor | None = None     # [world, nbytes], the parts side by side
        self._expected: torch.Tensor | None = None     # the header every rank's must equal (deferred verdicts)

    def resize(self, n_params: int, payload_nbytes: int, device) -> torch.Tensor:
        """The send buffer for this layout; returns the payload part (after the prefix)."""
        self.n_params, start = n_params, prefix_nbytes(n_params)
        self.buffer = _reuse(self.buffer, start + payload_nbytes, torch.uint8, device)
        return self.buffer[start:]

    @property
    def payload(self) -> torch.Tensor:
        return self.buffer[prefix_nbytes(self.n_params):]

    def seal(self, step: int, flags: int, present: list[bool], nonfinite: torch.Tensor | None = None) -> None:
        self._prefix.write(self.buffer, step, flags, present, nonfinite)
        self._present = list(present)

    def checkpoint(self) -> list[torch.Tensor]:
        return [self.buffer.clone()]

    def resume(self, saved: list[torch.Tensor]) -> None:
        _put_back([self.buffer], saved)
        self._prefix = PrefixWriter()                 # the prefix is the checkpoint's now
        self._present = _presence_bits(saved[0], self.n_params)
        self.start()

    def _receive_buffers(self, parts: list[slice]) -> list[torch.Tensor]:
        """[world, part] receive buffers for these parts and the [world, nbytes] they are
        joined in, allocated when the message's size changes, reused every step."""
        shapes = [(self.comm.world_size, p.stop - p.start) for p in parts]
        if [tuple(r.shape) for r in self._received] != shapes or self._received[0].device != self.buffer.device:
            self._received = [torch.empty(shape, dtype=torch.uint8, device=self.buffer.device) for shape in shapes]
            self._gathered = (self._received[0] if len(parts) == 1 else
                              torch.empty(self.comm.world_size, self.buffer.numel(), dtype=torch.uint8,
                                          device=self.buffer.device))
        return self._received

    def start(self) -> None:
        parts = gather_parts(self.buffer.numel())
        self._pending = [self.comm.all_gather(self.buffer[part], tag=self.tag, out=out, async_op=True)
                         for part, out in zip(parts, self._receive_buffers(parts))]

    def finish(self, step: int) -> Delivery:
        parts, self._pending = [pending.wait() for pending in self._pending], []
        gathered = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1, out=self._gathered)  # [world, nbytes]
        start = prefix_nbytes(self.n_params)
        prefixes, world = gathered[:, :start], self.comm.world_size
        presence = Presence(self._present, lambda: read_presence(prefixes, self.n_params))

        def defer(extra: list) -> tuple:
            if self._expected is None or self._expected.device != self.buffer.device:
                self._expected = torch.empty(HEADER_NBYTES, dtype=torch.uint8, device=self.buffer.device)
            self._expected.copy_(self.buffer[:HEADER_NBYTES])         # this rank's header, flags byte 0:
            self._expected[2].fill_(0)                                 # any rank's flag differs from it
            return (headers_skip(prefixes, self._expected, extra), header_evidence(prefixes, extra),
                    lambda values: judge_headers(values, world, step))
        return Delivery(lambda extra: read_verdict(prefixes, step, extra), presence, gathered[:, start:], defer)


class ReduceAll:
    """One all_reduce (sum) of [payload | trailer] in a float dtype; data: the payload's mean
    over ranks (a view of the reused buffer). A sum that overflowed counts as non-finite."""

    def __init__(self, comm: Communicator, tag: str = "payload"):
        self.comm, self.tag, self.buffer, self.n_params, self.numel = comm, tag, None, 0, 0
        self._pending = None
        self._trailer, self._present = TrailerWriter(), []

    def resize(self, n_params: int, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        self.n_params, self.numel = n_params, numel
        self.buffer = _reuse(self.buffer, numel + trailer_numel(n_params), dtype, device)
        return self.buffer[:numel]

    @property
    def payload(self) -> torch.Tensor:
        return self.buffer[:self.numel]

    def seal(self, step: int, flags: int, present: list[bool], nonfinite: torch.Tensor | None = None) -> None:
        self._trailer.write(self.buffer[self.numel:], step, bool(flags & FLAG_NONFINITE), present, nonfinite)
        self._present = list(present)

    def checkpoint(self) -> list[torch.Tensor]:
        """The sum over ranks: the all_reduce runs in place, so the message is gone once it
        has run; waiting for it changes nothing but when this returns."""
        return [self._pending.wait().clone()]

    def resume(self, saved: list[torch.Tensor]) -> None:
        """The sum is back in the buffer: nothing to send, finish() delivers it."""
        _put_back([self.buffer], saved)
        self._trailer, self._present = TrailerWriter(), [False] * self.n_params   # presence: read from the sum
        self._pending = Pending(None, self.buffer)

    def start(self) -> None:
        self._pending = self.comm.all_reduce(self.buffer, tag=self.tag, async_op=True)

    def finish(self, step: int) -> Delivery:
        total, self._pending = self._pending.wait(), None
        world = self.comm.world_size
        mean = total[:self.numel].div_(world)
        trailer = total[self.numel:]

        def judge(values: list) -> tuple[list, list[bool]]:
            bad, finite, extra_values = judge_trailer(values, world, step)
            return ([f"{bad} rank(s)"] if bad else [] if finite else ["the sum (overflow)"]), extra_values

        def defer(extra: list) -> tuple:
            evidence = trailer_evidence(trailer, step, mean, extra)
            return trailer_skip(evidence, world), evidence, judge
        return Delivery(lambda extra: judge(trailer_evidence(trailer, step, mean, extra).tolist()),
                        Presence(self._present, lambda: trailer[1 + LOCKSTEP_SLOTS:] > 0), mean, defer)


class OneBitReduce:
    """APMSqueeze's compressed all-reduce of a flat float32 vector with worker and server
    error feedback; the prefix travels at the head of every phase-1 chunk. data: m̄ [N]."""

    def __init__(self, comm: Communicator, tag: str = "payload"):
        self.comm, self.tag, self.n_params = comm, tag, 0
        self.reduce = OneBitAllReduce(comm, tag)
        self.prefix = None
        self._prefix, self._present = PrefixWriter(), []

    def resize(self, n_params: int, x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor):
        self.n_params = n_params
        self.x, self.worker_error, self.server_error = x, worker_error, server_error
        self.prefix = _reuse(self.prefix, prefix_nbytes(n_params), torch.uint8, x.device)

    @property
    def payload(self) -> torch.Tensor:
        return self.x

    def seal(self, step: int, flags: int, present: list[bool], nonfinite: torch.Tensor | None = None) -> None:
        # finite gradients can still make a non-finite momentum or error (overflow near float max)
        if not all_finite([self.x, self.worker_error]):
            flags |= FLAG_NONFINITE
        self._prefix.write(self.prefix, step, flags, present, nonfinite)
        self._present = list(present)

    def checkpoint(self) -> list[torch.Tensor]:
        """m_i and the prefix (the worker error start() adds is APMSqueeze's own state)."""
        return [self.x.clone(), self.prefix.clone()]

    def resume(self, saved: list[torch.Tensor]) -> None:
        _put_back([self.x, self.prefix], saved)
        self._prefix = PrefixWriter()                 # the prefix is the checkpoint's now
        self._present = _presence_bits(self.prefix, self.n_params)
        self.start()

    def start(self) -> None:
        self.reduce.start(self.x, self.worker_error, self.prefix)

    def finish(self, step: int) -> Delivery:
        prefixes = self.reduce.wait_headers()                    # [W, prefix], before any state changes
        flagged = read_headers(prefixes, step)
        present = Presence(self._present, lambda: read_presence(prefixes, self.n_params))
        if flagged:
            self.reduce.abandon()
            return Delivery(_read_now(flagged), present, None)
        return Delivery(_read_now([]), present, self.reduce.finish(self.worker_error, self.server_error, out=self.x))


class ServerRelay:
    """gather of [prefix | uplink] to rank 0; there `serve(uplinks, present, down_payload)`
    runs the server step (uplinks: every rank's payload, [world, nbytes], as GatherAll delivers); one broadcast of [prefix | downlink] carries its answer, the
    verdict and the presence union to every rank. data: the downlink buffer (all ranks).
    An error the server raises (a malformed payload) reaches every rank as PeerMismatchError."""

    def __init__(self, comm: Communicator, serve: Callable):
        self.comm, self.serve, self.n_params = comm, serve, 0
        self.up = self.down = None
        self._pending = None
        self._prefix, self._present = PrefixWriter(), []

    def resize(self, n_params: int, up_nbytes: int, down_nbytes: int, device) -> torch.Tensor:
        self.n_params, start = n_params, prefix_nbytes(n_params)
        self.up = _reuse(self.up, start + up_nbytes, torch.uint8, device)
        self.down = _reuse(self.down, start + down_nbytes, torch.uint8, device)
        return self.up[start:]

    @property
    def payload(self) -> torch.Tensor:
        return self.up[prefix_nbytes(self.n_params):]

    def seal(self, step: int, flags: int, present: list[bool], nonfinite: torch.Tensor | None = None) -> None:
        self._prefix.write(self.up, step, flags, present, nonfinite)
        self._present = list(present)

    def checkpoint(self) -> list[torch.Tensor]:
        return [self.up.clone()]

    def resume(self, saved: list[torch.Tensor]) -> None:
        _put_back([self.up], saved)
        self._prefix = PrefixWriter()
        self._present = _presence_bits(saved[0], self.n_params)
        self.start()

    def start(self) -> None:
        self._pending = self.comm.gather(self.up, dst=0, tag="payload", async_op=True)

    def finish(self, step: int) -> Delivery:
        gathered, self._pending = self._pending.wait(), None
        start, error = prefix_nbytes(self.n_params), None
        if self.comm.rank == 0:
            error = self._serve(gathered, step)
        self.comm.broadcast(self.down, src=0, tag="downlink")
        if error is not None:
            raise error
        if int(self.down[2]) & FLAG_SERVER_ERROR:
            raise PeerMismatchError(f"rank 0 (the server) rejected the messages of step {step}; its error names the cause")
        prefix = self.down[None, :start]
        flagged = ["reported by rank 0"] if read_headers(prefix, step) else []
        present = Presence(self._present, lambda: read_presence(prefix, self.n_params))
        return Delivery(_read_now(flagged), present, self.down[start:])

    def _serve(self, gathered: torch.Tensor, step: int):
        """Rank 0: verdict, presence union and server step into self.down; an error to re-raise."""
        start = prefix_nbytes(self.n_params)
        try:
            prefixes = gathered[:, :start]
            bad = read_headers(prefixes, step)
            present = read_presence(prefixes, self.n_params)
            if not bad:
                self.serve(gathered[:, start:], present, self.down[start:])
            write_prefix(self.down, step, FLAG_NONFINITE if bad else 0, present.tolist())
            return None
        except (PeerMismatchError, ValueError) as err:   # tell the others before raising
            write_prefix(self.down, step, FLAG_SERVER_ERROR, [False] * self.n_params)
            return err
