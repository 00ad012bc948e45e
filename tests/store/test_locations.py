"""Locations: write-once objects, listings by folder, counted traffic, and clear errors,
against a real temporary folder and a real S3-API server (conftest.py)."""

from __future__ import annotations

import sys
import threading

import pytest

from thinwire.store import FileLocation, LocationError, StoreTraffic, open_location
from thinwire.store.s3 import INSTALL_HINT

from .conftest import CREDENTIALS


def test_put_once_never_overwrites(location_spec):
    location = open_location(location_spec[0], **location_spec[1])
    assert location.put_once("rounds/0000000001/sites/a", b"first")
    assert not location.put_once("rounds/0000000001/sites/a", b"second")
    assert location.get("rounds/0000000001/sites/a") == b"first"
    assert location.get("rounds/0000000001/sites/b") is None


def test_list_is_by_folder_and_sorted(location_spec):
    location = open_location(location_spec[0], **location_spec[1])
    for key in ["rounds/0000000002/sites/b", "rounds/0000000002/sites/a", "rounds/0000000002/manifest",
                "rounds/00000000023/sites/a", "other"]:
        assert location.put_once(key, key.encode())
    assert location.list("rounds/0000000002/") == ["rounds/0000000002/manifest", "rounds/0000000002/sites/a",
                                                   "rounds/0000000002/sites/b"]
    assert location.list("rounds/0000000002/sites") == ["rounds/0000000002/sites/a", "rounds/0000000002/sites/b"]
    assert location.list("rounds/0000000009") == []
    assert len(location.list()) == 5


def test_traffic_counts_requests_and_bytes(location_spec):
    location = open_location(location_spec[0], **location_spec[1])
    before = location.traffic.copy()      # open_location's check listed once
    location.put_once("k/a", b"12345")
    location.put_once("k/a", b"123")      # refused, yet its bytes crossed the link
    location.get("k/a")
    location.get("k/missing")
    location.list("k")
    assert location.traffic.minus(before) == StoreTraffic(puts=2, gets=2, lists=1, bytes_written=8, bytes_read=5)
    assert location.traffic.minus(before).requests == 5


def test_one_writer_wins_a_race(location_spec):
    """Eight threads create one key at once: exactly one succeeds, and its bytes are the object."""
    location = open_location(location_spec[0], **location_spec[1])
    start, won = threading.Barrier(8), {}

    def create(i: int) -> None:
        start.wait()
        won[i] = location.put_once("race/key", f"writer {i}".encode())

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in won.items() if ok]
    assert len(winners) == 1
    assert location.get("race/key") == f"writer {winners[0]}".encode()


def test_file_location_hides_temporary_names(tmp_path):
    location = FileLocation(tmp_path)
    location.put_once("a/b", b"x")
    (tmp_path / "a" / ".b.tmp-123-abc").write_bytes(b"half")       # a writer still at work
    assert location.list() == ["a/b"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".b.tmp-123-abc", "b"]


@pytest.mark.parametrize("key", ["", "/a", "a//b", "../a", "a/.hidden", "a b", "a\\b"])
def test_invalid_keys_are_refused(tmp_path, key):
    with pytest.raises(ValueError, match="invalid object key"):
        FileLocation(tmp_path).put_once(key, b"x")


@pytest.mark.parametrize("url", ["http://example.com/x", "gs://bucket/x", "ftp://host/dir"])
def test_unsupported_scheme_is_named(url):
    with pytest.raises(ValueError, match=f"unsupported location scheme '{url.split(':')[0]}'"):
        open_location(url)


@pytest.mark.parametrize("url", ["file://host/dir", "file:relative/dir", "s3:///prefix-without-bucket"])
def test_malformed_urls_are_refused(url):
    with pytest.raises(ValueError, match="invalid"):
        open_location(url)


def test_file_location_that_is_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(LocationError, match="not a folder"):
        open_location((tmp_path / "f").as_uri())


def test_missing_s3_client_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)      # as if not installed
    with pytest.raises(ImportError, match=r"pip install thinwire\[store\]"):
        open_location("s3://bucket/prefix")
    assert "pip install thinwire[store]" in INSTALL_HINT


def test_missing_bucket_is_named(s3_endpoint):
    with pytest.raises(LocationError, match="no such bucket 'thinwire-no-such-bucket'"):
        open_location("s3://thinwire-no-such-bucket/run", endpoint=s3_endpoint, **CREDENTIALS)
