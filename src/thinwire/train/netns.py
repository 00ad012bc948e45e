"""An emulated slow link: every worker (or every site of workers) in its own network
namespace, joined by a bridge.

    with EmulatedLink(workers=4, rate_bps=100e6, delay_s=0.0) as link:
        launch(fn, 4, namespaces=link.namespaces, ifname=link.ifname)
    with EmulatedLink(workers=4, rate_bps=100e6, sites=2) as link:     # 2 sites of 2 workers
        launch(fn, 4, namespaces=link.namespaces, ifname=link.ifname)

Site s (by default each worker is its own site) is namespace `tw<pid>n<s>`, holding workers
s·W/S ... (s+1)·W/S − 1 (`namespaces[i]` is worker i's), with one veth end named `twl`
(address 10.231.0.<s+1>/24; the addresses exist only inside the namespaces we create) and
the other end on a bridge in the host namespace. Workers of one site share the address:
traffic between them is local to the namespace (the kernel routes it over loopback) and
never shaped; only traffic between sites crosses the veths. A token-bucket filter
(`tc qdisc ... tbf`) limits both directions of every site's link to `rate_bps`: the
namespace side shapes what the site sends, the bridge side what it receives, so a
full-duplex link of that rate shared by the site's workers. A
one-way delay, when asked for, is a netem qdisc on the namespace side (it needs the
kernel's sch_netem). Needs root and iproute2 (`available()` says why not). Everything is
removed on exit from the `with` block — normal, exception, Ctrl-C — and at interpreter
exit; SIGTERM is turned into KeyboardInterrupt while the link exists, so it too unwinds.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess

IFNAME = "twl"
CLONE_NEWNET = 0x40000000


def available() -> tuple[bool, str]:
    """(True, '') when links can be emulated here, else (False, the reason)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "emulating a link needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"emulating a link needs iproute2: `{tool}` is not on PATH"
    return True, ""


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _tbf(rate_bps: float) -> list[str]:
    rate_bytes = rate_bps / 8
    burst = int(max(16_000, rate_bytes / 100))               # 10 ms of tokens
    limit = int(max(256_000, rate_bytes / 5))                # 200 ms of queue: no drops
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


class EmulatedLink:
    def __init__(self, workers: int, rate_bps: float, delay_s: float = 0.0, sites: int | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        sites = workers if sites is None else sites
        if sites < 1 or workers % sites:
            raise ValueError(f"sites must divide workers ({workers}), got {sites}")
        if not rate_bps > 0:
            raise ValueError(f"rate_bps must be > 0, got {rate_bps}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.workers, self.sites, self.rate_bps, self.delay_s = workers, sites, rate_bps, delay_s
        tag = f"tw{os.getpid()}"
        self.site_namespaces = [f"{tag}n{s}" for s in range(sites)]
        self.namespaces = [self.site_namespaces[i // (workers // sites)] for i in range(workers)]   # per worker
        self.host_ends = [f"{tag}h{s}" for s in range(sites)]
        self.bridge = f"{tag}br"
        self.ifname = IFNAME
        self._created: list[tuple[str, str]] = []                 # ('netns'|'link', name)
        self._old_sigterm = None

    def addresses(self) -> list[str]:
        """One per site."""
        return [f"10.231.0.{s + 1}" for s in range(self.sites)]

    def __enter__(self) -> "EmulatedLink":
        ok, reason = available()
        if not ok:
            raise RuntimeError(reason)
        atexit.register(self.close)
        self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        for ns, host, addr in zip(self.site_namespaces, self.host_ends, self.addresses()):
            _run("ip", "netns", "add", ns)
            self._created.append(("netns", ns))
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            self._created.append(("link", host))
            _run("ip", "link", "set", host, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", host, "root", *_tbf(self.rate_bps))
            if self.delay_s > 0:
                try:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", "handle", "1:",
                         "netem", "delay", f"{self.delay_s * 1e6:.0f}us", "limit", "100000")
                except RuntimeError as err:
                    raise RuntimeError(f"a link delay needs the kernel's netem qdisc (sch_netem): {err}") from None
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "parent", "1:1",
                     "handle", "10:", *_tbf(self.rate_bps))
            else:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", *_tbf(self.rate_bps))

    def close(self) -> None:
        """Remove what was created, newest first; idempotent, never raises."""
        while self._created:
            kind, name = self._created.pop()
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            subprocess.run(cmd, capture_output=True)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        atexit.unregister(self.close)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def enter_namespace(name: str) -> None:
    """Move the calling process (before it starts threads) into network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
