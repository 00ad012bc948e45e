"""IsolatedSites, the store exchange's network: a site reaches the host, where the store
listens, and never another site, through a link whose rate is really limited; everything is
removed afterwards. The link tests need root and iproute2 (skipped with the reason otherwise)."""

import socket
import subprocess
import sys
import threading
import time

import pytest

from thinwire.train.netns import available
from thinwire.train.netns_isolated import IsolatedSites

ok, reason = available()
needs_links = pytest.mark.skipif(not ok, reason=f"link emulation unavailable: {reason}")

NBYTES = 1_000_000
RATE_BPS = 10e6                     # 1 MB at 10 Mbit/s: 0.8 s on the wire

# Run inside site 0's namespace (a fresh interpreter, so the test process never moves): one
# connection to site 1, which must fail, then NBYTES to the store's address.
SITE = """
import socket, sys
other, store, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    socket.create_connection((other, port), timeout=1.0).close()
    print("reached-other-site")
except OSError as err:
    print("other-site-unreachable", type(err).__name__)
with socket.create_connection((store, port), timeout=10.0) as conn:
    conn.sendall(b"x" * nbytes)
print("sent")
"""


def _receive(server: socket.socket, got: dict) -> None:
    """Accept one connection and read it to EOF; record bytes and seconds from accept."""
    conn, _ = server.accept()
    with conn:
        start, total = time.perf_counter(), 0
        while chunk := conn.recv(1 << 16):
            total += len(chunk)
        got["bytes"], got["seconds"] = total, time.perf_counter() - start


def _names(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True).stdout


@needs_links
def test_sites_reach_the_store_not_each_other_at_the_rate():
    net = IsolatedSites(2, RATE_BPS)
    with net, socket.create_server(("0.0.0.0", 0)) as server:     # the store's side: every host address
        port, got = server.getsockname()[1], {}
        receiver = threading.Thread(target=_receive, args=(server, got), daemon=True)
        receiver.start()
        assert open(f"/proc/sys/net/ipv4/conf/{net.host_ends[0]}/forwarding").read().strip() == "0"
        site = subprocess.run(["ip", "netns", "exec", net.namespaces[0], sys.executable, "-c", SITE,
                               net.site_address(1), net.store_address(0), str(port), str(NBYTES)],
                              capture_output=True, text=True, timeout=30)
        receiver.join(timeout=10)
        assert site.returncode == 0, site.stderr
        assert site.stdout.split()[:1] == ["other-site-unreachable"], site.stdout
        assert got["bytes"] == NBYTES
        line_rate_s = NBYTES * 8 / RATE_BPS                       # 0.8 s
        assert 0.6 * line_rate_s < got["seconds"] < 4 * line_rate_s, got
    assert not any(ns in _names(["ip", "netns", "list"]) for ns in net.namespaces)
    assert not any(end in _names(["ip", "-o", "link", "show"]) for end in net.host_ends)


@needs_links
def test_removed_on_exception():
    net = IsolatedSites(1, 50e6)
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            assert net.namespaces[0] in _names(["ip", "netns", "list"])
            raise RuntimeError("boom")
    assert net.namespaces[0] not in _names(["ip", "netns", "list"])


@needs_links
def test_two_at_once_take_different_subnets():
    # the host ends' addresses are in the host's routing table: a second instance (another
    # benchmark or test) on the same subnet would steal the first one's traffic
    with IsolatedSites(2, 50e6) as first, IsolatedSites(2, 50e6) as second:
        ours = {first.store_address(s) for s in range(2)} | {first.site_address(s) for s in range(2)}
        theirs = {second.store_address(s) for s in range(2)} | {second.site_address(s) for s in range(2)}
        assert not ours & theirs


@pytest.mark.parametrize("kwargs, name", [({"sites": 0, "rate_bps": 1e6}, "sites"),
                                          ({"sites": 2, "rate_bps": 0}, "rate_bps"),
                                          ({"sites": 2, "rate_bps": 1e6, "delay_s": -1}, "delay_s")])
def test_invalid_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        IsolatedSites(**kwargs)
    with pytest.raises(ValueError, match="site"):
        IsolatedSites(2, 1e6).store_address(2)
