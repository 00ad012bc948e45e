"""Compressed collectives built on the `Communicator`: the two-phase 1-bit all-reduce with
worker and server error feedback (the collective of APMSqueeze / 1-bit Adam), and the
lossy parameter-delta codec that LoRDO and DiLoCo synchronise with.

W ranks hold a flat float32 buffer x of N elements, N a multiple of 8W (`padded_numel`),
cut into W chunks of c = N / W elements; chunk j belongs to "server" rank j.

    phase 1, rank i:  y = x + e_w                              e_w: worker error [N]
        per chunk j:  s_ij = ||y_j||_2 / sqrt(c),  ŷ_j = s_ij sign(y_j)
                      e_w ← y − ŷ                              what compression lost
        chunk j (header | s_ij | c/8 bytes of packed signs) goes to rank j: one all_to_all
                      (rank i's own chunk i stays local: it is not handed to the collective)
    server, rank j:   z = (Σ_i ŷ_ij) / W  (summed in rank order) + e_s      e_s: server error [c]
                      s_j = ||z||_2 / sqrt(c),  ẑ = s_j sign(z),  e_s ← z − ẑ
    phase 2:          (s_j | c/8 bytes of signs of z) from every rank: one all_gather;
                      every rank decodes the same m̄ = [ẑ_0, ..., ẑ_{W−1}].

Choices, where DeepSpeed (`compressed_allreduce`, called per tensor) differs: the worker
scale is one RMS per chunk (DeepSpeed: one per tensor) at the same wire cost (W floats leave
each rank either way) and a tighter fit; `scales=TensorScales(...)` gives DeepSpeed's
granularity instead (`thinwire.comm.onebit_scales`: S scales per chunk message, one per
tensor part; the formulas below are the default's, S = 1). Scales travel inside the byte
messages, so each phase is a single collective. Signs follow `thinwire.wire.pack_signs`: bit 1 for y >= 0, so an exact
zero (and -0.0) is sent as +s, as in DeepSpeed, and its error −s is fed back; NaN codes as
−s, but its scale is NaN too, and callers flag non-finite input in the header anyway.

Decoding looks each byte up in a [256, 8] table of ±1 (one gather per phase) and multiplies
by the scale (exact); a rank's own ŷ and ẑ are ±scale by the very bits it packs, so the
error it keeps is exactly input − (what every receiver decodes). Nothing is read on the
host: the scales' overflow-safe norm (`rms_scales`), the packing (`pack_rows`) and a
flagged step's masked error updates (`finish(skip=...)`) all stay on the device. Buffers
are reused through an optional `workspace` dict, since on CPU fresh multi-MB tensors cost more in page faults than the
arithmetic done in them.

Payload bytes per rank and step: phase 1 (W−1)·(H + 4 + N/(8W)) (the chunks bound for
peers), phase 2 4 + N/(8W), with H the header length (8 for APMSqueeze's protocol header, 0
without): N/8 + W·(H + 4) − H in all, 1 bit per element as the 1-bit Adam paper counts it,
≈ 1/32 of the fp32 gradient. Link bytes per rank (comm/links.py): phase 1 as much, phase 2
(W−1)·(4 + N/(8W)), ≈ 1/32 of what a ring all-reduce of fp32 sends.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..wire import get_codec
from .communicator import Communicator
from .onebit_scales import ChunkScales, rms_scales  # noqa: F401  (rms_scales: importable from here too)

SCALE_NBYTES = 4


def padded_numel(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of 8 * world_size (whole bytes of signs per chunk), >= 8W."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    unit = 8 * world_size
    return max(1, -(-numel // unit)) * unit


def _buf(workspace: dict | None, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A reusable buffer from `workspace` (allocated on first use or when the shape changes)."""
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = workspace.get(name)
    if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or buf.device != torch.device(device):
        buf = workspace[name] = torch.empty(shape, dtype=dtype, device=device)
    return buf


_SIGN_TABLE: dict = {}
_BIT_WEIGHTS: dict = {}


def _sign_table(device) -> torch.Tensor:
    """[256, 8] float32: row b holds ±1 for the 8 bits of byte b, least significant first (1 -> +1)."""
    key = str(device)
    if key not in _SIGN_TABLE:
        bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
        _SIGN_TABLE[key] = bits.to(torch.float32).mul_(2).sub_(1)
    return _SIGN_TABLE[key]


def _bit_weights(device) -> torch.Tensor:
    """[8] uint8: 2^j, the weight of bit j of a byte."""
    key = str(device)
    if key not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[key] = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=device)
    return _BIT_WEIGHTS[key]


def pack_rows(flags: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """flags [rows, cols] bool (contiguous, cols a multiple of 8) -> out [rows, cols/8] uint8
    (may be a strided slice of a message): bit j of byte k = flags[8k + j], as `pack_signs`."""
    rows, cols = flags.shape
    # byte k = Σ_j 2^j b_(8k+j): at most 255, exact in uint8
    bits = flags.view(torch.uint8).view(rows, cols // 8, 8)                      # [rows, cols/8, 8]
    return torch.sum(bits * _bit_weights(flags.device), dim=2, dtype=torch.uint8, out=out)


def decode_signs(scales: torch.Tensor, bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """scales [rows] float32 (or each element's, [rows, cols]), bits [rows, cols/8] uint8 (may be
    strided) -> ±scale [rows, cols] (into `out` if given): one lookup of ±1 per byte, one multiply (exact)."""
    rows, nbytes = bits.shape
    if out is None:
        out = torch.empty(rows, nbytes * 8, dtype=torch.float32, device=bits.device)
    index = bits.to(torch.int32).view(-1)                                        # [rows · cols/8]
    torch.index_select(_sign_table(bits.device), 0, index, out=out.view(rows * nbytes, 8))
    return out.mul_(scales if scales.dim() == 2 else scales.view(rows, 1))


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.to(torch.float32).contiguous().view(torch.uint8).view(-1, SCALE_NBYTES)


def _read_scales(block: torch.Tensor) -> torch.Tensor:
    """[rows, 4S] uint8 (maybe a strided slice) -> float32 [rows, S]."""
    fresh = block.clone(memory_format=torch.contiguous_format)                 # fresh: aligned
    return fresh.view(-1).view(torch.float32).view(block.shape[0], -1)


def sign_message(y: torch.Tensor, h: int = 0, workspace: dict | None = None, name: str = "send",
                 scales: torch.Tensor | None = None):
    """y [rows, cols] -> (message [rows, h + 4S + cols/8] uint8 with the first h bytes of each row
    left for a header, S scales and packed signs after them; scales [rows, S] (given, or one RMS
    per row); y >= 0 [rows, cols])."""
    rows, cols = y.shape
    scales = rms_scales(y, workspace).view(rows, 1) if scales is None else scales
    start = h + SCALE_NBYTES * scales.shape[1]
    send = _buf(workspace, name, (rows, start + cols // 8), torch.uint8, y.device)
    send[:, h: start] = _scale_bytes(scales).view(rows, -1)
    positive = torch.ge(y, 0, out=_buf(workspace, name + "_ge", (rows, cols), torch.bool, y.device))
    pack_rows(positive, send[:, start:])
    return send, scales, positive


def sign_error_(target: torch.Tensor, scales: torch.Tensor, positive: torch.Tensor, error: torch.Tensor,
                skip: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> None:
    """error ← target − ŷ, ŷ = ±scale as the message codes it (+ where `positive`; scales
    [rows, 1] or each element's): what every receiver decodes, exactly. Where `skip` (a 0-dim
    bool), error is left as it was."""
    # ŷ = where(y >= 0, s, −s)
    y_hat = torch.where(positive, scales, scales.neg(),
                        out=scratch if scratch is not None else torch.empty_like(target))
    if skip is None:
        # e ← y − ŷ
        torch.sub(target, y_hat, out=error)
        return
    # e ← y − ŷ, or e where skip
    torch.where(skip, error, y_hat.neg_().add_(target), out=error)


class OneBitAllReduce:
    """The module docstring's collective, split where the envelope needs it: `start` issues
    phase 1 (asynchronously); `wait_headers` returns every rank's header bytes once phase 1
    arrived, before any state changes; then either `abandon` (a flagged step: no error
    buffer is touched) or `finish` (worker and server errors updated in place, phase 2 run,
    m̄ returned). `finish(skip=...)` decides on the device instead: phase 2 runs either way and
    the errors stay as they were where `skip` (a 0-dim bool) is set. Nothing here reads the
    device on the host."""

    def __init__(self, comm: Communicator, tag: str = "payload", workspace: dict | None = None, scales=None):
        self.comm, self.tag = comm, tag
        self.workspace = {} if workspace is None else workspace
        self.scales = ChunkScales() if scales is None else scales     # `thinwire.comm.onebit_scales`
        self._state = None

    def start(self, x: torch.Tensor, worker_error: torch.Tensor, header: torch.Tensor | None = None,
              flag: tuple[int, int] | None = None) -> None:
        """x, worker_error: float32 [N], N a multiple of 8W; header: uint8 bytes prefixed to every
        chunk; flag (byte, bit): set in every chunk's header when a scale of y is not finite."""
        w, n = self.comm.world_size, x.numel()
        if n % (8 * w) or worker_error.numel() != n:
            raise ValueError(f"x and worker_error need N = a multiple of 8W = {8 * w} elements; "
                             f"got {n} and {worker_error.numel()}")
        c, h, ws = n // w, 0 if header is None else header.numel(), self.workspace
        # y = x + e_w, [W, c]: chunk j goes to server rank j
        y = torch.add(x, worker_error, out=_buf(ws, "y", (n,), torch.float32, x.device)).view(w, c)
        send, scales, positive = sign_message(y, h, ws, "send1", self.scales.worker(y, ws))
        if h:
            send[:, :h] = header
            if flag is not None:
                # non-finite y ⇔ a non-finite scale: s − s is NaN exactly then
                largest = scales.max()
                gap = largest - largest
                bit = gap.ne(gap).to(torch.uint8)
                send[:, flag[0]].bitwise_or_(bit if flag[1] == 1 else bit.mul_(flag[1]))
        pending = self.comm.all_to_all(send.view(-1), tag=self.tag, send_own=False, async_op=True)
        self._state = (pending, y, scales, positive, h)

    def wait_headers(self) -> torch.Tensor:
        pending, *rest = self._state
        received = pending.wait()                                   # [W, H + 4 + c/8], from rank i
        self._state = (received, *rest)
        return received[:, :rest[-1]]

    def abandon(self) -> None:
        self._state = None

    def finish(self, worker_error: torch.Tensor, server_error: torch.Tensor,
               out: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> torch.Tensor:
        received, y, scales, positive, h = self._state
        self._state, ws = None, self.workspace
        w, c = y.shape
        if server_error.numel() != c:
            raise ValueError(f"server_error needs N / W = {c} elements, got {server_error.numel()}")
        dev = y.device
        scratch = _buf(ws, "decoded", (w, c), torch.float32, dev)
        g, rank, start = self.scales, self.comm.rank, SCALE_NBYTES * self.scales.count
        sign_error_(y, g.spread(scales), positive, worker_error.view(w, c), skip, scratch)   # e_w ← y − ŷ
        z = server_mean(received, h, ws, lambda s: g.spread(s, rank), g.count).add_(server_error)  # mean ŷ_i + e_s
        z_scales = g.server(z.view(1, c), rank, ws)
        send2, _, z_positive = sign_message(z.view(1, c), 0, ws, "send2", z_scales)
        gathered = self.comm.all_gather(send2.view(-1), tag=self.tag)    # [W, 4S + c/8], rank order
        sign_error_(z.view(1, c), g.spread(z_scales, rank), z_positive, server_error.view(1, c), skip,
                    scratch[:1])                                          # e_s ← z − ẑ
        if out is None:
            out = torch.empty(w * c, dtype=torch.float32, device=dev)
        decode_signs(g.spread(_read_scales(gathered[:, :start])), gathered[:, start:], out=out.view(w, c))
        return out


def compressed_allreduce(comm: Communicator, x: torch.Tensor, worker_error: torch.Tensor,
                         server_error: torch.Tensor, header: torch.Tensor | None = None,
                         check: Callable[[torch.Tensor], None] | None = None, tag: str = "payload",
                         workspace: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of every rank's x, 1-bit compressed twice with error feedback, in one call.

    check(headers [W, H]) runs on every rank between the phases and may raise (all ranks see
    the same headers, so all raise), in which case nothing was modified. Otherwise
    worker_error and server_error are updated in place and m̄ [N] is returned."""
    reduce = OneBitAllReduce(comm, tag, workspace)
    reduce.start(x, worker_error, header)
    headers = reduce.wait_headers()
    if check is not None:
        try:
            check(headers)
        except BaseException:
            reduce.abandon()
            raise
    return reduce.finish(worker_error, server_error, out)


def server_mean(received: torch.Tensor, h: int = 0, workspace: dict | None = None,
                spread: Callable | None = None, count: int = 1) -> torch.Tensor:
    """(Σ_i ŷ_i) / W over the chunk messages received in phase 1 ([W, h + 4S + c/8], S = count
    scales each), summed in rank order, so the result depends on nothing but the bytes.
    spread: [W, S] scales -> each element's (default: S = 1, one per row)."""
    w, start = received.shape[0], h + SCALE_NBYTES * count
    scales = _read_scales(received[:, h: start])                              # [W, S]
    c = (received.shape[1] - start) * 8
    decoded = decode_signs(scales if spread is None else spread(scales), received[:, start:],
                           out=_buf(workspace, "decoded", (w, c), torch.float32, received.device))
    total = _buf(workspace, "z", (c,), torch.float32, received.device)
    if w == 1:
        total.copy_(decoded[0])
    else:
        torch.add(decoded[0], decoded[1], out=total)
    for row in decoded[2:]:   # W rows, not elements: a fixed, documented summation order
        total.add_(row)
    return total.div_(w)


DELTA_WIRES = ("fp32", "bf16", "int8")
INT8_BLOCK = 256          # values per int8 scale


class DeltaCodec:
    """A flat float32 vector <-> bytes for the lossy parameter-delta syncs of LoRDO and
    DiLoCo: 'bf16', or 'int8' with one fp32 scale per block of 256 values (zero-padded).

    A compressed sum cannot be re-quantised at every ring hop without losing more, so each
    rank all-gathers its encoded vector and every rank decodes all rows in rank order and
    sums them in float32 in that order (`mean`): deterministic, so replicas stay identical.
    """

    def __init__(self, wire: str):
        if wire not in DELTA_WIRES[1:]:
            raise ValueError(f"a lossy delta wire must be one of {DELTA_WIRES[1:]}, got {wire!r}")
        self.wire, self.codec = wire, get_codec(wire)

    def _grid(self, n: int) -> tuple[int, int]:
        return (math.ceil(n / INT8_BLOCK), INT8_BLOCK) if self.wire == "int8" else (1, n)

    def nbytes(self, n: int) -> int:
        return self.codec.nbytes(*self._grid(n))

    def encode(self, x: torch.Tensor, out: torch.Tensor, error: torch.Tensor | None = None) -> None:
        """x [n] float32 -> out [nbytes]; error ← x − what receivers decode (when given)."""
        n = x.numel()
        rows, cols = self._grid(n)
        grid = torch.zeros(rows * cols, dtype=torch.float32, device=x.device)
        grid[:n].copy_(x)
        self.codec.encode(grid.view(rows, cols), out=out)
        if error is not None:
            torch.sub(x, self.codec.decode(out, rows, cols).view(-1)[:n], out=error)

    def mean(self, rows_bytes: torch.Tensor, n: int) -> torch.Tensor:
        """[W, nbytes] encoded rows -> their mean [n] float32, summed in rank order."""
        rows, cols = self._grid(n)
        total = torch.zeros(n, dtype=torch.float32, device=rows_bytes.device)
        for row in rows_bytes:                      # ranks, not elements
            total += self.codec.decode(row, rows, cols).view(-1)[:n]
        return total.div_(rows_bytes.shape[0])
