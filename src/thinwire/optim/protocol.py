"""What every thinwire message carries besides its payload, and the checks built on it.

Each rank's message starts with a prefix: an 8-byte header, then a presence bitmap.

    byte 0    magic 0x54 ('T')        byte 2    flags (bit 0: this rank's gradients were not finite)
    byte 1    format version (2)      byte 3    reserved (0)
    bytes 4-7 optimizer step, uint32 little-endian
    bytes 8-  ceil(P / 8) bytes: bit i (least significant first) set when this rank has a
              gradient for the i-th of the P parameters in the message's layout

Every rank sees every prefix in the same collective that carries the payloads, so a
non-finite gradient or a rank out of lockstep is detected by all ranks at once, in the same
step, with no extra round trip: every rank raises the same error, none is left waiting;
and every rank learns which parameters had a gradient on no rank, which then do not move.
Float all-reduces cannot carry bytes: they carry the same facts as a trailer of floats
that the sum keeps exact (`trailer_nbytes`). A one-time handshake compares a fingerprint of
the parameter shapes and wire settings before the first message, so ranks that disagree
fail with a clear error instead of exchanging buffers of different sizes.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..comm import Communicator

HEADER_NBYTES = 8
MAGIC, VERSION = 0x54, 2
FLAG_NONFINITE = 1
NONFINITE_POLICIES = ("raise", "skip")
LOCKSTEP_SLOTS = 16          # float trailers: one-hot of step mod 16 (exact in bf16 up to 256 ranks)


class NonFiniteGradientError(RuntimeError):
    """Some rank's gradients were not finite; raised on every rank in the same step."""


class PeerMismatchError(RuntimeError):
    """Ranks disagree on parameter shapes, wire settings or step; raised on every rank."""


def prefix_nbytes(n_params: int) -> int:
    """Header plus presence bitmap for a layout of `n_params` parameters."""
    return HEADER_NBYTES + math.ceil(n_params / 8)


def write_prefix(buf: torch.Tensor, step: int, flags: int, present: list[bool]) -> None:
    """Fill the first prefix_nbytes(len(present)) bytes of a uint8 message buffer."""
    bits = sum(1 << i for i, here in enumerate(present) if here)
    prefix = [MAGIC, VERSION, flags, 0, *int(step % 2**32).to_bytes(4, "little"),
              *bits.to_bytes(math.ceil(len(present) / 8), "little")]
    buf[:len(prefix)].copy_(torch.tensor(prefix, dtype=torch.uint8))


def write_header(buf: torch.Tensor, step: int, flags: int) -> None:
    """Fill the first HEADER_NBYTES bytes (a prefix with no presence bitmap)."""
    write_prefix(buf, step, flags, [])


def read_headers(headers: torch.Tensor, step: int) -> torch.Tensor:
    """Validate all ranks' headers ([world, >= 8] uint8); return the ranks with non-finite flags."""
    h = headers[:, :HEADER_NBYTES].to(torch.int64)
    bad = ((h[:, 0] != MAGIC) | (h[:, 1] != VERSION)).nonzero().flatten().tolist()
    if bad:
        raise PeerMismatchError(f"malformed message header from rank(s) {bad} (wrong magic or version)")
    steps = h[:, 4] | (h[:, 5] << 8) | (h[:, 6] << 16) | (h[:, 7] << 24)
    expected = step % 2**32
    if bool((steps != expected).any()):
        raise PeerMismatchError(
            f"ranks are out of lockstep: optimizer steps per rank are {steps.tolist()} "
            f"(this rank expects {expected}); were they resumed from different checkpoints?")
    return ((h[:, 2] & FLAG_NONFINITE) != 0).nonzero().flatten()


def read_presence(prefixes: torch.Tensor, n_params: int) -> torch.Tensor:
    """[world, prefix] uint8 -> bool [n_params]: which parameters had a gradient on some rank."""
    bitmap = prefixes[:, HEADER_NBYTES: prefix_nbytes(n_params)].to(torch.int64)
    anywhere = torch.zeros(bitmap.shape[1], dtype=torch.int64, device=bitmap.device)
    for row in bitmap:       # ranks, not elements
        anywhere |= row
    bits = (anywhere[:, None] >> torch.arange(8, device=bitmap.device)) & 1        # [bytes, 8]
    return bits.reshape(-1)[:n_params].bool()


def trailer_numel(n_params: int) -> int:
    """Floats appended to an all-reduced buffer: [flag, one-hot step mod 16, presence per parameter]."""
    return 1 + LOCKSTEP_SLOTS + n_params


def write_trailer(trailer: torch.Tensor, step: int, nonfinite: bool, present: list[bool]) -> None:
    """The float trailer of one rank; summed over ranks it counts flags, steps and presence."""
    values = [float(nonfinite)] + [0.0] * LOCKSTEP_SLOTS + [float(here) for here in present]
    values[1 + step % LOCKSTEP_SLOTS] = 1.0
    trailer.copy_(torch.tensor(values, dtype=trailer.dtype))


def read_trailer(trailer: torch.Tensor, step: int, world: int) -> tuple[int, torch.Tensor]:
    """The summed trailer -> (number of ranks that flagged non-finite gradients, presence
    bool [n_params]); PeerMismatchError when the ranks were not all at `step` (mod 16)."""
    values = trailer.to(torch.float64)
    slots = values[1: 1 + LOCKSTEP_SLOTS]
    if float(slots[step % LOCKSTEP_SLOTS]) != world or float(slots.sum()) != world:
        raise PeerMismatchError(f"ranks are out of lockstep at step {step}: step mod {LOCKSTEP_SLOTS} "
                                f"counts per slot are {slots.tolist()}; were they resumed from different checkpoints?")
    return int(values[0]), values[1 + LOCKSTEP_SLOTS:] > 0


def fingerprint(description: str) -> torch.Tensor:
    """8 bytes identifying `description` (shapes, dtypes, wire settings)."""
    digest = hashlib.blake2b(description.encode(), digest_size=8).digest()
    return torch.tensor(list(digest), dtype=torch.uint8)


def handshake(comm: Communicator, description: str) -> None:
    """Raise PeerMismatchError on every rank unless all ranks have the same description."""
    if comm.world_size == 1:
        return  # nobody to disagree with
    mine = fingerprint(description)
    everyone = comm.all_gather(mine, tag="handshake")
    differs = (everyone != mine[None]).any(dim=1).nonzero().flatten().tolist()
    if differs:
        raise PeerMismatchError(
            "parameter shapes, dtypes, wire settings or steps differ across ranks "
            f"(rank {comm.rank} disagrees with rank(s) {differs}). This rank has:\n{description[:2000]}")


def check_nonfinite_policy(nonfinite: str) -> str:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    return nonfinite


def all_finite(tensors) -> bool:
    """True when every tensor is finite; one host sync for the whole list.

    A float sum propagates NaN and inf and costs one fast pass; only when a sum is not
    finite (which a huge but finite tensor can also cause) is the exact check run.
    """
    tensors = list(tensors)
    if not tensors:
        return True
    if bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors])).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)
