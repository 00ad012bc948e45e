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

Every exchange keeps the `Exchange` contract (`thinwire.optim.delivery`); OneBitReduce and
ServerRelay live in `thinwire.optim.relay`. A step in flight is checkpointed by
`checkpoint()` (copies of what `start()` sent from; ReduceAll, whose all_reduce overwrites
its message with the sum, waits for it and keeps the sum) and, sized by `resize` again in a
fresh optimizer, `resume(saved)` puts that back and starts the exchange as it was, so it
delivers what the interrupted one would have.
"""

from __future__ import annotations

import torch

from ..comm import Communicator, Pending
from .delivery import Delivery, Exchange, presence_bits, put_back  # noqa: F401  (Exchange: the contract)
from .flat import reuse
from .protocol import (FLAG_NONFINITE, HEADER_NBYTES, LOCKSTEP_SLOTS, PrefixWriter, Presence, TrailerWriter,
                       header_evidence, headers_skip, judge_headers, judge_trailer, prefix_nbytes, read_presence,
                       read_verdict, trailer_evidence, trailer_numel, trailer_skip)
from .relay import FLAG_SERVER_ERROR, OneBitReduce, ServerRelay  # noqa: F401  (importable from here too)


# A GatherAll message leaves as one all_gather per PART_BYTES started, at most MAX_PARTS, all in
# flight at once. Over an emulated 10 Mbit/s link (2 ranks, 129 KB each, 150 ms apart) one
# all_gather took 0.100 s median but 0.109-0.114 s mean and up to 0.184 s; four took 0.100-0.102 s
# mean and at most 0.115 s (benchmarks/link_exchange.py --gap 0.15 --max-parts 1 4).
PART_BYTES = 32 * 1024
MAX_PARTS = 4


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
        self.buffer = reuse(self.buffer, start + payload_nbytes, torch.uint8, device)
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
        put_back([self.buffer], saved)
        self._prefix = PrefixWriter()                 # the prefix is the checkpoint's now
        self._present = presence_bits(saved[0], self.n_params)
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
        # the store exchange agrees on whole messages, one round each: a split one could
        # arrive in part
        parts = [slice(0, self.buffer.numel())] if self.comm.WHOLE_MESSAGES else gather_parts(self.buffer.numel())
        self._pending = [self.comm.all_gather(self.buffer[part], tag=self.tag, out=out, async_op=True)
                         for part, out in zip(parts, self._receive_buffers(parts))]

    def finish(self, step: int) -> Delivery:
        parts = [pending.wait() for pending in self._pending]
        absent = {r for pending in self._pending for r in pending.absent}
        self._pending = []
        gathered = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1, out=self._gathered)  # [world, nbytes]
        if absent:
            return self._partial(step, gathered, absent)
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

    def _partial(self, step: int, gathered: torch.Tensor, absent: set[int]) -> Delivery:
        """A store round whose manifest left ranks out: only the rows it holds, so every site
        checks and applies the same messages (a 'mean' is over them); read on the host, not
        deferred (the masked landings index rows by rank)."""
        rows = [r for r in range(self.comm.world_size) if r not in absent]
        if not rows:
            raise RuntimeError(f"step {step}: the store round holds no message at all")
        kept = gathered[rows]                                           # [arrived, nbytes], a copy
        start, excluded = prefix_nbytes(self.n_params), self.comm.rank in absent
        prefixes = kept[:, :start]
        # presence from the rows that arrived: this rank's own is not one of them when excluded
        local = [False] * len(self._present) if excluded else self._present
        presence = Presence(local, lambda: read_presence(prefixes, self.n_params))
        delivery = Delivery(lambda extra: read_verdict(prefixes, step, extra), presence, kept[:, start:],
                            rows=rows, excluded_self=excluded)
        # its own flag, which no other site saw (one host read, on this rare path only)
        delivery.own_flagged = excluded and bool(int(self.buffer[2].item()) & FLAG_NONFINITE)
        return delivery


class ReduceAll:
    """One all_reduce (sum) of [payload | trailer] in a float dtype; data: the payload's mean
    over ranks (a view of the reused buffer). A sum that overflowed counts as non-finite."""

    def __init__(self, comm: Communicator, tag: str = "payload"):
        self.comm, self.tag, self.buffer, self.n_params, self.numel = comm, tag, None, 0, 0
        self._pending = None
        self._trailer, self._present = TrailerWriter(), []

    def resize(self, n_params: int, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        self.n_params, self.numel = n_params, numel
        self.buffer = reuse(self.buffer, numel + trailer_numel(n_params), dtype, device)
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
        put_back([self.buffer], saved)
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
