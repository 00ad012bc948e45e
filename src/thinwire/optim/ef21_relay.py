"""EF21-Muon's server exchange with no host read on its way: `DeviceRelay`.

Like `thinwire.optim.relay.ServerRelay` (which it extends), every rank's [prefix | uplink]
is gathered to rank 0, rank 0 runs the server step and broadcasts [prefix | downlink]. What
ServerRelay judges on rank 0's host before answering (the headers, the presence union, the
server's own errors) is judged there on the device instead, into the answer's prefix:

    flags byte   FLAG_NONFINITE when some rank flagged its gradients; FLAG_SERVER_ERROR when
                 a header differs from rank 0's own in magic, version or step, or the server
                 found a malformed payload (its decode's device flag)
    presence     the union of every rank's bitmap (bitwise, on the device)

so the server step runs whatever the verdict, into candidates that only the step's apply
commits (`thinwire.optim.ef21_muon`). Every rank then reads the answer's header, with the
algorithm's own arrival flags, in the step's one host read (`Delivery.check`): a server error
makes rank 0 name its cause (reading the gathered headers: PeerMismatchError, else ValueError
for a malformed payload) and the others raise PeerMismatchError, as with ServerRelay. An error
the server raises on the host (a compressor without a block form checks as it decodes) is
handled as ServerRelay handles it.

`serve(uplinks, down_payload, step)`: uplinks [world, payload bytes]; returns the malformed
flag (0-dim bool on the device) or None.
"""

from __future__ import annotations

import torch

from ..compress.topk import MALFORMED
from .delivery import Delivery
from .flat import reuse
from .protocol import (FLAG_NONFINITE, HEADER_NBYTES, PeerMismatchError, PrefixWriter, Presence, header_evidence,
                       headers_skip, judge_headers, prefix_nbytes, read_presence, write_prefix)
from .relay import FLAG_SERVER_ERROR, ServerRelay


def presence_union(bitmaps: torch.Tensor) -> torch.Tensor:
    """[world, bytes] uint8 presence bitmaps -> [bytes] uint8, their bitwise OR, on the device
    in a number of launches that does not grow with the world size."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmaps.device)
    bits = bitmaps[:, :, None].bitwise_right_shift(shifts).bitwise_and_(1)          # [world, bytes, 8]
    return bits.amax(dim=0).bitwise_left_shift_(shifts).sum(dim=1, dtype=torch.uint8)


class DeviceRelay(ServerRelay):
    """ServerRelay whose verdict travels in the answer's prefix (module docstring)."""

    def __init__(self, comm, serve):
        super().__init__(comm, serve)
        self._answer = PrefixWriter()
        self._expected: torch.Tensor | None = None        # this rank's header, flags byte 0 (`_defer`)

    def finish(self, step: int) -> Delivery:
        gathered, self._pending = self._pending.wait(), None
        error = self._serve(gathered, step) if self.comm.rank == 0 else None
        self.comm.broadcast(self.down, src=0, tag="downlink")
        if error is not None:
            raise error
        start = prefix_nbytes(self.n_params)
        prefix = self.down[None, :start]
        present = Presence(self._present, lambda: read_presence(prefix, self.n_params))
        return Delivery(lambda extra: self._verdict(prefix, gathered, step, extra), present, self.down[start:],
                        lambda extra: self._defer(prefix, gathered, step, extra))

    def _serve(self, gathered: torch.Tensor, step: int):
        """Rank 0: the server step into self.down and the verdict into its prefix, no host read;
        an error raised on the host is returned to re-raise after the broadcast."""
        start, n = prefix_nbytes(self.n_params), self.n_params
        try:
            heads = gathered[:, :HEADER_NBYTES]
            differs = heads.ne(self.up[:HEADER_NBYTES])                    # magic, version, step: as rank 0's
            differs[:, 2].zero_()                                          # the flags byte may differ
            malformed = self.serve(gathered[:, start:], self.down[start:], step)
            error = differs.any() if malformed is None else differs.any().logical_or_(malformed)
            flagged = heads[:, 2].bitwise_and(FLAG_NONFINITE).any()
            self._answer.write(self.down, step, 0, [False] * n)
            self.down[2].copy_(error.to(torch.uint8).mul_(FLAG_SERVER_ERROR).bitwise_or_(flagged))
            self.down[HEADER_NBYTES:start].copy_(presence_union(gathered[:, HEADER_NBYTES:start]))
            return None
        except (PeerMismatchError, ValueError) as err:                    # tell the others before raising
            write_prefix(self.down, step, FLAG_SERVER_ERROR, [False] * n)
            self._answer = PrefixWriter()
            return err

    def _verdict(self, prefix: torch.Tensor, gathered: torch.Tensor | None, step: int, extra: list):
        """The step's one host read: the answer's header and `extra`; (flagged, extra values)."""
        values = header_evidence(prefix, extra).tolist()
        heads = None if gathered is None else (lambda: gathered[:, :HEADER_NBYTES].reshape(-1).tolist())
        return self._judge(values, heads, step)

    def _defer(self, prefix: torch.Tensor, gathered: torch.Tensor | None, step: int, extra: list):
        """`Delivery.defer` (nonfinite='skip', `thinwire.optim.verdict`): skip where the answer's
        header is not this step's or carries a flag, or an `extra` flag is set; the evidence is
        the answer's header and `extra` (and on rank 0 the gathered headers, which name a
        server error's cause), judged at the next call."""
        self._expected = reuse(self._expected, HEADER_NBYTES, torch.uint8, self.up.device)
        self._expected.copy_(self.up[:HEADER_NBYTES])
        self._expected[2].fill_(0)                                         # FLAG_NONFINITE / FLAG_SERVER_ERROR: skip
        evidence = header_evidence(prefix, extra)
        n = evidence.numel()
        if gathered is not None:
            evidence = torch.cat([evidence, gathered[:, :HEADER_NBYTES].reshape(-1)])
        return (headers_skip(prefix, self._expected, extra), evidence,
                lambda values: self._judge(values[:n], None if gathered is None else (lambda: values[n:]), step))

    def _judge(self, values: list[int], heads, step: int):
        """The answer's header and extra flags (`values`), and on rank 0 every rank's header
        (`heads()`, read only for a server error) -> (flagged, extra values); a server error
        raises: rank 0 names its cause (PeerMismatchError from the headers, else a malformed
        payload), the others PeerMismatchError."""
        if values[2] & FLAG_SERVER_ERROR:
            if heads is not None:                                          # rank 0 names the cause
                rows = heads()
                judge_headers(rows, len(rows) // HEADER_NBYTES, step)
                raise ValueError(f"{MALFORMED} at step {step} (in an uplink, found by rank 0, the server)")
            raise PeerMismatchError(f"rank 0 (the server) rejected the messages of step {step}; its error names the cause")
        flagged, extra_values = judge_headers(values, 1, step)
        return (["reported by rank 0"] if flagged else []), extra_values
