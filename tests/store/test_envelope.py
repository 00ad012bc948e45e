"""Signed messages: a genuine one opens; forged, replayed, misplaced and garbled ones are
rejected with their reason before anything reads their payload."""

from __future__ import annotations

import pytest

from thinwire.store import RejectedMessage, open_envelope, run_fingerprint, seal
from thinwire.store.envelope import CRC_NBYTES, MAC_NBYTES

KEY = b"run key"
RUN = run_fingerprint('{"run": 1}')
PAYLOAD = bytes(range(256)) * 3


def sealed(payload=PAYLOAD, key=KEY, fingerprint=RUN, round=7, site="site-a") -> bytes:
    return seal(payload, key=key, fingerprint=fingerprint, round=round, site=site)


def rejection(blob: bytes, round=7, site="site-a", key=KEY) -> RejectedMessage:
    with pytest.raises(RejectedMessage) as caught:
        open_envelope(blob, key=key, fingerprint=RUN, round=round, site=site)
    assert caught.value.site == site
    return caught.value


def test_a_genuine_message_opens():
    message = open_envelope(sealed(), key=KEY, fingerprint=RUN, round=7, site="site-a")
    assert (message.payload, message.round, message.site, message.fingerprint) == (PAYLOAD, 7, "site-a", RUN)
    assert open_envelope(sealed(b""), key="run key", fingerprint=RUN, round=7).payload == b""


def test_sealing_is_deterministic():
    """A site that retries a round writes the same bytes, so its retry is recognised."""
    assert sealed() == sealed()


def test_wrong_key_is_forged():
    err = rejection(sealed(key=b"someone else's key"))
    assert err.reason == "forged" and "HMAC" in str(err)


def test_another_round_is_replayed():
    err = rejection(sealed(round=6))
    assert err.reason == "replayed" and "round 6, expected 7" in str(err)


def test_another_run_is_replayed():
    err = rejection(sealed(fingerprint=run_fingerprint('{"run": 2}')))
    assert err.reason == "replayed" and "another run" in str(err)


def test_another_sites_message_is_misplaced():
    err = rejection(sealed(site="site-b"))
    assert err.reason == "misplaced" and "'site-b'" in str(err)


@pytest.mark.parametrize("at", [0, 10, 40, 60, 500, -MAC_NBYTES - 1])
def test_a_flipped_byte_outside_the_mac_is_garbled(at):
    blob = bytearray(sealed())
    blob[at] ^= 0x10
    assert rejection(bytes(blob)).reason == "garbled"


def test_a_flipped_byte_in_the_mac_is_forged():
    blob = bytearray(sealed())
    blob[-1] ^= 0x01
    assert rejection(bytes(blob)).reason == "forged"


@pytest.mark.parametrize("keep", [0, 3, 30, 50, 400, -1])
def test_a_truncated_message_is_garbled(keep):
    assert rejection(sealed()[:keep]).reason == "garbled"


def test_trailing_bytes_are_garbled():
    assert rejection(sealed() + b"\0").reason == "garbled"


def test_a_forger_who_fixes_the_crc_is_still_forged():
    """The CRC only tells damage from forgery; the HMAC is the guard."""
    import zlib
    genuine = sealed()
    body_end = len(genuine) - MAC_NBYTES - CRC_NBYTES
    body = bytearray(genuine[:body_end])
    body[-1] ^= 0xFF                                          # change the payload's last byte
    forged = bytes(body) + zlib.crc32(body).to_bytes(CRC_NBYTES, "little") + genuine[-MAC_NBYTES:]
    assert rejection(forged).reason == "forged"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        sealed(fingerprint=b"short")
    with pytest.raises(ValueError, match="site id"):
        sealed(site="")
    with pytest.raises(ValueError, match="key is empty"):
        sealed(key=b"")
