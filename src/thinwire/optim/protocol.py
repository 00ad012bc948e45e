"""What every thinwire message carries besides its payload, and the checks built on it.

Each rank's message starts with an 8-byte header:

    byte 0    magic 0x54 ('T')        byte 2    flags (bit 0: this rank's gradients were not finite)
    byte 1    format version (1)      byte 3    reserved (0)
    bytes 4-7 optimizer step, uint32 little-endian

Every rank sees every header in the same collective that carries the payloads, so a
non-finite gradient or a rank out of lockstep is detected by all ranks at once, in the same
step, with no extra round trip: every rank raises the same error, none is left waiting.
A one-time handshake compares a fingerprint of the parameter shapes and wire settings
before the first message, so ranks that disagree fail with a clear error instead of
exchanging buffers of different sizes.
"""

from __future__ import annotations

import hashlib

import torch

from ..comm import Communicator

HEADER_NBYTES = 8
MAGIC, VERSION = 0x54, 1
FLAG_NONFINITE = 1
NONFINITE_POLICIES = ("raise", "skip")


class NonFiniteGradientError(RuntimeError):
    """Some rank's gradients were not finite; raised on every rank in the same step."""


class PeerMismatchError(RuntimeError):
    """Ranks disagree on parameter shapes, wire settings or step; raised on every rank."""


def write_header(buf: torch.Tensor, step: int, flags: int) -> None:
    """Fill the first HEADER_NBYTES bytes of a uint8 message buffer."""
    buf[:4] = torch.tensor([MAGIC, VERSION, flags, 0], dtype=torch.uint8)
    buf[4:8] = torch.tensor(list(int(step % 2**32).to_bytes(4, "little")), dtype=torch.uint8)


def read_headers(headers: torch.Tensor, step: int) -> torch.Tensor:
    """Validate all ranks' headers ([world, 8] uint8); return the ranks with non-finite flags."""
    h = headers.to(torch.int64)
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
            "parameter shapes, dtypes or wire settings differ across ranks "
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
