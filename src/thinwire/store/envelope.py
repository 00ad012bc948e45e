"""Signed messages: what makes an object in a shared store belong to this run, round and site.

Anyone with write access to a bucket, or a bug, can leave an object where a site's message
should be. Every message therefore travels in an envelope that binds its payload to the run
(a fingerprint of the run's configuration), the round and the sending site, under an
HMAC-SHA256 with a key the run's sites are given. `open_envelope` checks all of it before
anything reads the payload, so a thinwire message decoder never sees bytes that do not belong.

    bytes 0-3     b"TWS1" (magic and envelope version)
    bytes 4-35    run fingerprint, SHA-256 (`run_fingerprint`)
    bytes 36-43   round, uint64 little-endian
    byte  44      n, the site id's length in bytes (1-255)
    45 .. 45+n    site id, UTF-8
    next 8 bytes  payload length, uint64 little-endian
    payload
    4 bytes       CRC-32 of everything above (tells garbling from forgery, not a guard)
    32 bytes      HMAC-SHA256(key, everything above)

The reasons a message is rejected, checked in this order:
    'garbled'   not an envelope, truncated, or a CRC mismatch: damaged in the store or on the way
    'forged'    well formed, but the HMAC does not match: written without this run's key
    'replayed'  genuine, but of another run (fingerprint) or another round
    'misplaced' genuine and of this round, but from another site than the key it was found at
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"TWS1"
FINGERPRINT_NBYTES = 32
MAC_NBYTES = 32
CRC_NBYTES = 4
_HEAD = struct.Struct(f"<4s{FINGERPRINT_NBYTES}sQB")     # magic, fingerprint, round, site length
_LENGTH = struct.Struct("<Q")
REASONS = ("garbled", "forged", "replayed", "misplaced")


class RejectedMessage(ValueError):
    """An object that is not a genuine message of this run, round and site.

    `reason` is one of REASONS; `site` is the key's site when known (for the log and the
    manifest); str(err) says what was wrong.
    """

    def __init__(self, reason: str, detail: str, site: str | None = None) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.site = reason, detail, site


@dataclass(frozen=True)
class SignedMessage:
    fingerprint: bytes
    round: int
    site: str
    payload: bytes


def run_fingerprint(config: str | bytes) -> bytes:
    """32 bytes that name a run: SHA-256 of its configuration (e.g. the canonical JSON of
    the model, optimizer and data settings). Runs that share a key still reject each
    other's messages as 'replayed' when their configurations differ."""
    return hashlib.sha256(config.encode() if isinstance(config, str) else bytes(config)).digest()


def _as_key(key: str | bytes) -> bytes:
    key = key.encode() if isinstance(key, str) else bytes(key)
    if not key:
        raise ValueError("the run's HMAC key is empty")
    return key


def seal(payload: bytes, *, key: str | bytes, fingerprint: bytes, round: int, site: str) -> bytes:
    """The envelope around `payload`, signed with `key`."""
    site_id = site.encode()
    if len(fingerprint) != FINGERPRINT_NBYTES:
        raise ValueError(f"a run fingerprint has {FINGERPRINT_NBYTES} bytes, got {len(fingerprint)}")
    if not 1 <= len(site_id) <= 255:
        raise ValueError(f"a site id has 1 to 255 UTF-8 bytes, got {site!r}")
    body = b"".join([_HEAD.pack(MAGIC, fingerprint, round, len(site_id)), site_id,
                     _LENGTH.pack(len(payload)), bytes(payload)])
    body += zlib.crc32(body).to_bytes(CRC_NBYTES, "little")
    return body + hmac.new(_as_key(key), body, hashlib.sha256).digest()


def _parse(blob: bytes) -> tuple[SignedMessage, bytes, bytes]:
    """(message, signed body, mac) of a structurally sound envelope, else RejectedMessage."""
    tail = CRC_NBYTES + MAC_NBYTES
    if len(blob) < _HEAD.size + 1 + _LENGTH.size + tail or blob[:4] != MAGIC:
        raise RejectedMessage("garbled", f"not a thinwire envelope ({len(blob)} bytes)")
    _, fingerprint, round_, n_site = _HEAD.unpack_from(blob)
    at = _HEAD.size + n_site
    if n_site == 0 or len(blob) < at + _LENGTH.size + tail:
        raise RejectedMessage("garbled", "truncated in its header")
    (n_payload,) = _LENGTH.unpack_from(blob, at)
    end = at + _LENGTH.size + n_payload
    if len(blob) != end + tail:
        raise RejectedMessage("garbled", f"{len(blob)} bytes where its header says {end + tail}")
    if zlib.crc32(blob[:end]) != int.from_bytes(blob[end:end + CRC_NBYTES], "little"):
        raise RejectedMessage("garbled", "CRC mismatch")
    try:
        site = blob[_HEAD.size:at].decode()
    except UnicodeDecodeError:
        raise RejectedMessage("garbled", "site id is not UTF-8") from None
    message = SignedMessage(fingerprint, round_, site, blob[at + _LENGTH.size:end])
    return message, blob[:end + CRC_NBYTES], blob[end + CRC_NBYTES:]


def open_envelope(blob: bytes, *, key: str | bytes, fingerprint: bytes, round: int,
                  site: str | None = None) -> SignedMessage:
    """The verified message in `blob`, or RejectedMessage with the first reason that applies.

    `site`: the site whose key the object was found at (None: any site may have sent it).
    Nothing in the payload is read before every check has passed.
    """
    try:
        message, body, mac = _parse(bytes(blob))
        if not hmac.compare_digest(mac, hmac.new(_as_key(key), body, hashlib.sha256).digest()):
            raise RejectedMessage("forged", "HMAC mismatch: not signed with this run's key")
        if message.fingerprint != fingerprint:
            raise RejectedMessage("replayed", f"from another run (fingerprint {message.fingerprint.hex()[:12]})")
        if message.round != round:
            raise RejectedMessage("replayed", f"from round {message.round}, expected {round}")
        if site is not None and message.site != site:
            raise RejectedMessage("misplaced", f"sent by {message.site!r}, found at {site!r}'s key")
    except RejectedMessage as err:
        err.site = site
        raise
    return message
