"""The --link emulation: namespaces, bridge and tbf qdiscs are created, really limit the rate,
and are removed on normal exit, on an exception, on Ctrl-C and on SIGTERM. Root only."""

import signal
import subprocess
import sys
import time

import pytest

from thinwire.train import netns
from thinwire.train.netns import EmulatedLink, available

ok, reason = available()
pytestmark = pytest.mark.skipif(not ok, reason=f"link emulation unavailable: {reason}")


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def _gone(link: EmulatedLink) -> bool:
    names, links = _netns(), _links()
    return (not any(ns in names for ns in link.namespaces) and link.bridge not in links
            and not any(h in links for h in link.host_ends))


def test_setup_and_teardown():
    link = EmulatedLink(2, 20e6)
    with link:
        names = _netns()
        assert all(ns in names for ns in link.namespaces)
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", link.host_ends[0]], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "20Mbit" in qdisc
        inner = subprocess.run(["ip", "netns", "exec", link.namespaces[1], "tc", "qdisc", "show", "dev", link.ifname],
                               capture_output=True, text=True).stdout
        assert "tbf" in inner and "20Mbit" in inner
        addr = subprocess.run(["ip", "-n", link.namespaces[1], "-o", "addr", "show", link.ifname],
                              capture_output=True, text=True).stdout
        assert "10.231.0.2/24" in addr
    assert _gone(link)


def test_teardown_on_exception():
    link = EmulatedLink(3, 50e6)
    with pytest.raises(RuntimeError, match="boom"):
        with link:
            assert all(ns in _netns() for ns in link.namespaces)
            raise RuntimeError("boom")
    assert _gone(link)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_teardown_on_signal(sig):
    # netns.py needs no torch: load it by path so the child starts in well under a second
    # a runner started in the background (`cmd &`) passes SIGINT on as ignored; a terminal's
    # Ctrl-C reaches a process with Python's default handler, so the child restores it
    code = ("import importlib.util, signal, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"spec = importlib.util.spec_from_file_location('netns', {netns.__file__!r})\n"
            "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
            "with mod.EmulatedLink(2, 10e6) as link:\n"
            "    print(link.bridge, *link.namespaces, flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        bridge, *namespaces = proc.stdout.readline().split()
        assert all(ns in _netns() for ns in namespaces)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(ns in _netns() for ns in namespaces)
    assert bridge not in _links()


def _timed_all_reduce(rank, world, nbytes, result_path):
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(16))                          # connections up before timing
    buf = torch.ones(nbytes // 4)
    t = time.perf_counter()
    dist.all_reduce(buf)
    elapsed = time.perf_counter() - t
    if rank == 0:
        with open(result_path, "w") as f:
            f.write(f"{elapsed} {float(buf[0])}")


def test_rate_is_limited(tmp_path):
    """2 workers, ring all-reduce of n bytes moves n each way: at 16 Mbit/s, 2 MB take ~1 s."""
    from thinwire.train.launch import launch
    rate, nbytes = 16e6, 2_000_000
    expected = 8 * nbytes / rate
    out = tmp_path / "elapsed"
    with EmulatedLink(2, rate) as link:
        launch(_timed_all_reduce, 2, args=(nbytes, str(out)), namespaces=link.namespaces, ifname=link.ifname)
    elapsed, value = map(float, out.read_text().split())
    assert value == 2.0
    assert 0.7 * expected < elapsed < 2.0 * expected, (elapsed, expected)
    assert _gone(link)


def _timed_by_tier(rank, world, nbytes, result_path):
    """All-reduce inside site 0 (ranks 0, 1), then across the sites (ranks 0, 2): rank 0's times."""
    import torch
    import torch.distributed as dist
    groups = {name: dist.new_group(ranks) for name, ranks in (("site0", [0, 1]), ("site1", [2, 3]),
                                                               ("across0", [0, 2]), ("across1", [1, 3]))}
    dist.all_reduce(torch.ones(16))                          # every connection up before timing
    for name in ("site0", "across0"):
        if rank in dist.get_process_group_ranks(groups[name]):
            dist.all_reduce(torch.ones(16), group=groups[name])
    elapsed = {}
    for name in ("site0", "across0"):
        dist.barrier()
        if rank in dist.get_process_group_ranks(groups[name]):
            buf = torch.ones(nbytes // 4)
            t = time.perf_counter()
            dist.all_reduce(buf, group=groups[name])
            elapsed[name] = time.perf_counter() - t
    if rank == 0:
        with open(result_path, "w") as f:
            f.write(f"{elapsed['site0']} {elapsed['across0']}")


def test_sites_share_a_namespace_and_only_traffic_between_sites_is_limited(tmp_path):
    """2 sites x 2 workers at 16 Mbit/s: the workers of a site share one namespace and address;
    2 MB all-reduced inside a site take a small fraction of the ~1 s the same all-reduce
    takes across the sites (n bytes each way between two ranks over the site's link)."""
    from thinwire.train.launch import launch
    rate, nbytes = 16e6, 2_000_000
    expected = 8 * nbytes / rate
    out = tmp_path / "elapsed"
    with EmulatedLink(4, rate, sites=2) as link:
        assert link.namespaces == [link.site_namespaces[0]] * 2 + [link.site_namespaces[1]] * 2
        assert len(set(link.namespaces)) == 2 and link.addresses() == ["10.231.0.1", "10.231.0.2"]
        launch(_timed_by_tier, 4, args=(nbytes, str(out)), namespaces=link.namespaces, ifname=link.ifname)
    inside, across = map(float, out.read_text().split())
    assert 0.7 * expected < across < 2.0 * expected, (across, expected)
    assert inside < 0.2 * expected, (inside, expected)
    assert _gone(link)


def test_sites_must_divide_workers():
    with pytest.raises(ValueError, match="sites must divide workers"):
        EmulatedLink(4, 1e6, sites=3)
