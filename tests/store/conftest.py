"""The two kinds of location every store test runs against: a real temporary folder
(file://) and a real S3-API server on localhost (s3://), started here.

The S3 server is moto's (moto[server], ThreadedMotoServer, in the test extra): an HTTP
server speaking the S3 REST API, with PUT If-None-Match: * answered 412 when the key exists.
moto checks the condition and then writes, in separate steps, while serving requests on
several threads; real S3 makes the two one atomic step. This module serialises moto's
PutObject with a lock so the server keeps the promise the exchange relies on, and says so
(docs/design.md, "The store exchange", lists what moto does not cover). When moto or
obstore is not installed, the s3 cases are skipped with a reason that says what to install.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
import uuid
from collections.abc import Callable

import pytest

S3_MISSING = "the s3:// tests need obstore and moto[server]: pip install -c constraints.txt -e '.[test]' ({})"
CREDENTIALS = {"access_key_id": "thinwire-test", "secret_access_key": "thinwire-test", "region": "us-east-1"}


def _atomic_conditional_puts(response_class) -> Callable[[], None]:
    """Make moto's PutObject check-then-write one step, as S3's is; returns the undo."""
    original, lock = response_class.put_object, threading.Lock()

    def put_object(self):
        with lock:
            return original(self)

    response_class.put_object = put_object
    return lambda: setattr(response_class, "put_object", original)


@pytest.fixture(scope="session")
def s3_endpoint():
    """http://127.0.0.1:<port> of a moto S3 server running for the whole session."""
    try:
        import obstore  # noqa: F401
        from moto.s3.responses import S3Response
        from moto.server import ThreadedMotoServer
    except ImportError as err:
        pytest.skip(S3_MISSING.format(err))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)     # one line per request otherwise
    undo = _atomic_conditional_puts(S3Response)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    undo()


def make_bucket(endpoint: str) -> str:
    """A fresh, empty bucket on the test server (moto does not check signatures)."""
    bucket = f"thinwire-{uuid.uuid4().hex[:12]}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=30).close()
    return bucket


@pytest.fixture(params=["file", "s3"])
def location_spec(request, tmp_path):
    """(url, options) of an empty location: a temporary folder, or a fresh bucket's prefix."""
    if request.param == "file":
        return (tmp_path / "store").as_uri(), {}
    endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{make_bucket(endpoint)}/run-1", {"endpoint": endpoint, **CREDENTIALS}
