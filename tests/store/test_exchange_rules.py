"""RoundExchange's rules that need no second process: arguments, retries, and a store that
contradicts the agreement (which must fail loudly on every site, never be guessed around)."""

from __future__ import annotations

import logging

import pytest

from thinwire.store import ExchangeError, FileLocation, Manifest, RoundExchange, run_fingerprint, seal
from thinwire.store.manifest import manifest_key, message_key

KEY, CONFIG = b"key", "config"


def exchange_at(location, site="site-a", sites=("site-a", "site-b"), **kwargs) -> RoundExchange:
    return RoundExchange(location, site, list(sites), KEY, CONFIG, round_timeout=0.2, poll=(0.01, 0.05), **kwargs)


def signed_manifest(manifest: Manifest, key: bytes = KEY) -> bytes:
    return seal(manifest.to_json(), key=key, fingerprint=run_fingerprint(CONFIG), round=manifest.round,
                site=manifest.closed_by)


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="not one of the run's sites"):
        exchange_at(FileLocation(tmp_path), site="site-z")
    with pytest.raises(ValueError, match="invalid site id"):
        exchange_at(FileLocation(tmp_path), site="a/b", sites=["a/b"])
    with pytest.raises(ValueError, match="unsupported location scheme 'gs'"):
        exchange_at("gs://bucket/run")


def test_a_retried_round_recognises_its_own_object(tmp_path):
    exchange = exchange_at(FileLocation(tmp_path))
    assert exchange.publish(3, b"message")
    assert exchange.publish(3, b"message")          # the same bytes: already there
    assert not exchange.publish(3, b"another")      # the key holds something else


def test_alone_past_the_deadline_closes_with_itself(tmp_path):
    result = exchange_at(tmp_path.as_uri()).exchange(0, b"mine")
    assert result.messages == {"site-a": b"mine"} and result.late == ("site-b",)
    assert result.closed_here and result.included and result.waited_s >= 0.2


def test_a_forged_manifest_stops_the_round(tmp_path):
    location = FileLocation(tmp_path)
    location.put_once(manifest_key(0), signed_manifest(Manifest(0, "site-b", {}, {}, ()), key=b"forger"))
    with pytest.raises(ExchangeError, match="not this run's: forged"):
        exchange_at(location).exchange(0, b"mine")


def test_a_manifest_naming_bytes_the_store_lacks_stops_the_round(tmp_path):
    location = FileLocation(tmp_path)
    lie = Manifest(0, "site-b", {"site-a": "0" * 64, "site-b": "1" * 64}, {}, ())
    location.put_once(manifest_key(0), signed_manifest(lie))
    with pytest.raises(ExchangeError, match="store holds another or none"):
        exchange_at(location).exchange(0, b"mine")


def test_a_manifest_whose_envelope_and_closer_disagree_stops_the_round(tmp_path):
    location = FileLocation(tmp_path)
    blob = seal(Manifest(0, "site-b").to_json(), key=KEY, fingerprint=run_fingerprint(CONFIG), round=0,
                site="site-a")
    location.put_once(manifest_key(0), blob)
    with pytest.raises(ExchangeError, match="closing site"):
        exchange_at(location).exchange(0, b"mine")


def test_read_round_of_an_open_round_is_none(tmp_path):
    location = FileLocation(tmp_path)
    exchange = exchange_at(location)
    exchange.publish(0, b"mine")
    assert exchange.read_round(0) is None
    assert location.list("rounds") == [message_key(0, "site-a")]


def test_rejections_are_named_in_the_log(tmp_path, caplog):
    location = FileLocation(tmp_path)
    forged = seal(b"theirs", key=b"forger", fingerprint=run_fingerprint(CONFIG), round=0, site="site-b")
    location.put_once(message_key(0, "site-b"), forged)
    with caplog.at_level(logging.WARNING, logger="thinwire.store"):
        result = exchange_at(location).exchange(0, b"mine")
    assert result.rejected == {"site-b": "forged"} and result.messages == {"site-a": b"mine"}
    assert "round 0: rejected site-b's message: forged: HMAC mismatch" in caplog.text
