"""The exchanges that answer in more than one phase: APMSqueeze's 1-bit all-reduce
(`OneBitReduce`) and EF21-Muon's server (`ServerRelay`); the contract is
`thinwire.optim.delivery.Exchange`, the one-phase exchanges are in `thinwire.optim.exchange`."""

from __future__ import annotations

from typing import Callable

import torch

from ..comm import Communicator
from ..comm.collectives import OneBitAllReduce
from .delivery import Delivery, presence_bits, put_back, read_now
from .flat import reuse
from .protocol import (FLAG_NONFINITE, HEADER_NBYTES, PeerMismatchError, PrefixWriter, Presence, header_evidence,
                       headers_skip, judge_headers, prefix_nbytes, read_headers, read_presence, read_verdict,
                       write_prefix)

FLAG_SERVER_ERROR = 2          # a relayed answer's flag: the server rejected this step's messages
FLAGS_BYTE = 2                 # the header's flags byte (`protocol`)


class OneBitReduce:
    """APMSqueeze's compressed all-reduce of a flat float32 vector with worker and server
    error feedback; the prefix travels at the head of every phase-1 chunk. data: m̄ [N].

    A rank whose y = m_i + δ_i is not finite (finite gradients can still make a non-finite
    momentum or error, near float max) sets its flag in the chunks' headers on the device.
    `deferred` (nonfinite='skip' with an algorithm that lands masked) reads nothing on the
    host: phase 2 runs on a flagged step too, the error buffers stay as they were where the
    device's verdict says skip, and the delivery is `deferrable`. Otherwise the headers are
    read once after phase 1, and a flagged step is abandoned before phase 2."""

    def __init__(self, comm: Communicator, tag: str = "payload"):
        self.comm, self.tag, self.n_params = comm, tag, 0
        self.reduce = OneBitAllReduce(comm, tag)
        self.prefix = None
        self.deferred = False
        self._expected: torch.Tensor | None = None    # this rank's header, flags byte 0 (deferred)
        self._prefix, self._present = PrefixWriter(), []

    def resize(self, n_params: int, x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
               scales=None):
        """scales: the compressions' granularity (`thinwire.comm.onebit_scales`; None: one per chunk)."""
        self.n_params = n_params
        if scales is not None:
            self.reduce.scales = scales
        self.x, self.worker_error, self.server_error = x, worker_error, server_error
        self.prefix = reuse(self.prefix, prefix_nbytes(n_params), torch.uint8, x.device)

    @property
    def payload(self) -> torch.Tensor:
        return self.x

    def seal(self, step: int, flags: int, present: list[bool], nonfinite: torch.Tensor | None = None) -> None:
        self._prefix.write(self.prefix, step, flags, present, nonfinite)
        self._present = list(present)

    def checkpoint(self) -> list[torch.Tensor]:
        """m_i and the prefix (the worker error start() adds is APMSqueeze's own state)."""
        return [self.x.clone(), self.prefix.clone()]

    def resume(self, saved: list[torch.Tensor]) -> None:
        put_back([self.x, self.prefix], saved)
        self._prefix = PrefixWriter()                 # the prefix is the checkpoint's now
        self._present = presence_bits(self.prefix, self.n_params)
        self.start()

    def start(self) -> None:
        self.reduce.start(self.x, self.worker_error, self.prefix, flag=(FLAGS_BYTE, FLAG_NONFINITE))

    def finish(self, step: int) -> Delivery:
        prefixes = self.reduce.wait_headers()                    # [W, prefix], before any state changes
        present = Presence(self._present, lambda: read_presence(prefixes, self.n_params))
        if self.deferred:
            return self._finish_deferred(step, prefixes, present)
        flagged = read_headers(prefixes, step)
        if flagged:
            self.reduce.abandon()
            return Delivery(read_now(flagged), present, None)
        return Delivery(read_now([]), present, self.reduce.finish(self.worker_error, self.server_error, out=self.x))

    def _finish_deferred(self, step: int, prefixes: torch.Tensor, present: Presence) -> Delivery:
        """Phase 2 under the device's verdict (no host read); the delivery defers its judgement."""
        self._expected = reuse(self._expected, HEADER_NBYTES, torch.uint8, self.prefix.device)
        self._expected.copy_(self.prefix[:HEADER_NBYTES])
        self._expected[FLAGS_BYTE].fill_(0)                      # any rank's flag differs from it
        skip = headers_skip(prefixes, self._expected)
        data = self.reduce.finish(self.worker_error, self.server_error, out=self.x, skip=skip)
        world = self.comm.world_size

        def defer(extra: list) -> tuple:
            if extra:
                raise ValueError("OneBitReduce's deferred verdict masks the error feedback by the headers "
                                 "alone: the algorithm's arrival flags cannot join it")
            return skip, header_evidence(prefixes), lambda values: judge_headers(values, world, step)
        return Delivery(lambda extra: read_verdict(prefixes, step, extra), present, data, defer)


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
        self.up = reuse(self.up, start + up_nbytes, torch.uint8, device)
        self.down = reuse(self.down, start + down_nbytes, torch.uint8, device)
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
        put_back([self.up], saved)
        self._prefix = PrefixWriter()
        self._present = presence_bits(saved[0], self.n_params)
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
        return Delivery(read_now(flagged), present, self.down[start:])

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
