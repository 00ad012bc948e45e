"""Sites with no route between them, each behind its own slow link to the store's machine.

    with IsolatedSites(sites=2, rate_bps=100e6, delay_s=0.0) as net:
        # site s: a process that called enter_namespace(net.namespaces[s])
        # reaches the store server (listening on 0.0.0.0 in the host namespace) at
        # net.store_address(s), and cannot reach net.site_address(t) for any other site t

This is the store exchange's setting (issue 48: sites behind NAT or outbound-only firewalls,
which reach an object store and never each other), where `netns.EmulatedLink` puts every site
on one bridge. Site s is network namespace `tw<pid>b<b>i<s>` holding one end of a veth pair named
`twi` at 10.232.<s>.<4b+2>/30; the other end, `twb<b>j<s>`, stays in the host namespace at
10.232.<s>.<4b+1>/30, a subnet of its own (the addresses exist only on links created here).
The host ends' addresses are in the host's routing table, unlike EmulatedLink's, so two
instances at once (two benchmarks, a test beside a benchmark) must not share a subnet: each
takes the first block b (0-63) whose addresses no host interface holds, chosen under a file
lock, so the names and addresses are known inside the `with` block only.

Each site's default route points at its host end, so a packet for another site does reach the
host — and is dropped there: IPv4 forwarding is switched off on every host end (the per-interface
sysctl `net/ipv4/conf/<end>/forwarding`, checked on the interface a packet arrives on), which
leaves the host-wide setting alone and disappears with the interface. What a site can reach is
the host's own addresses, where the store listens.

Both ends of each link are shaped as EmulatedLink shapes them (`netns._tbf`): a token-bucket
filter at `rate_bps` on the namespace side (what the site uploads) and on the host side (what it
downloads), and the optional one-way delay as a netem qdisc on the namespace side. Needs root
and iproute2 (`netns.available()`). Everything is removed on exit from the `with` block, on an
exception, on Ctrl-C and SIGTERM (turned into KeyboardInterrupt while the sites exist) and at
interpreter exit.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile

from .netns import EmulatedLink, _run, _tbf

IFNAME = "twi"
MAX_SITES = 254          # one /30 per site and instance in 10.232.<s>.0/24
BLOCKS = 64              # /30s in a /24: instances that can exist at once
LOCK = os.path.join(tempfile.gettempdir(), "thinwire-isolated-sites.lock")


class IsolatedSites:
    """`sites` namespaces, each joined only to the host namespace by a link of `rate_bps`
    (bits per second, both directions) with an optional one-way `delay_s`."""

    def __init__(self, sites: int, rate_bps: float, delay_s: float = 0.0):
        if not 1 <= sites <= MAX_SITES:
            raise ValueError(f"sites must be in 1..{MAX_SITES}, got {sites}")
        if not rate_bps > 0:
            raise ValueError(f"rate_bps must be > 0, got {rate_bps}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.sites, self.rate_bps, self.delay_s = sites, rate_bps, delay_s
        self.namespaces: list[str] = []                          # set by _build, with the block
        self.host_ends: list[str] = []
        self.ifname = IFNAME
        self._created: list[tuple[str, str]] = []                 # ('netns'|'link', name)
        self._old_sigterm = None
        self._block: int | None = None                            # set by _build

    def store_address(self, site: int) -> str:
        """The host's address on site `site`'s link: where that site reaches the store."""
        return f"10.232.{self._check(site)}.{4 * self._block + 1}"

    def site_address(self, site: int) -> str:
        """Site `site`'s own address (reachable from the host only)."""
        return f"10.232.{self._check(site)}.{4 * self._block + 2}"

    def _check(self, site: int) -> int:
        if not 0 <= site < self.sites:
            raise ValueError(f"site must be in 0..{self.sites - 1}, got {site}")
        if self._block is None:
            raise RuntimeError("the sites' addresses exist only inside the `with IsolatedSites(...)` block")
        return site

    # The same lifetime as EmulatedLink's: _build() under a SIGTERM handler, close() (newest
    # first, idempotent, never raises) on every exit path and at interpreter exit. Deleting a
    # veth end deletes its peer and the end's sysctls with it, so close() has nothing else to undo.
    __enter__ = EmulatedLink.__enter__
    __exit__ = EmulatedLink.__exit__
    close = EmulatedLink.close

    def _build(self) -> None:
        with open(LOCK, "a") as lock:                  # one instance picks and claims a block at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
            free = [b for b in range(BLOCKS)
                    if not any(f" 10.232.{s}.{4 * b + 1}/" in held for s in range(self.sites))]
            if not free:
                raise RuntimeError(f"all {BLOCKS} address blocks of 10.232.0.0/16 are in use by other IsolatedSites")
            self._block = free[0]
            self.namespaces = [f"tw{os.getpid()}b{self._block}i{s}" for s in range(self.sites)]
            self.host_ends = [f"twb{self._block}j{s}" for s in range(self.sites)]   # the block is unique
            for site in range(self.sites):
                self._build_site(site)

    def _build_site(self, site: int) -> None:
        ns, host = self.namespaces[site], self.host_ends[site]
        _run("ip", "netns", "add", ns)
        self._created.append(("netns", ns))
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", IFNAME, "netns", ns)
        self._created.append(("link", host))
        # before the link is up, so no packet from the site is ever forwarded
        with open(f"/proc/sys/net/ipv4/conf/{host}/forwarding", "w") as sysctl:
            sysctl.write("0")
        _run("ip", "addr", "add", f"{self.store_address(site)}/30", "dev", host)
        _run("ip", "link", "set", host, "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.site_address(site)}/30", "dev", IFNAME)
        _run("ip", "-n", ns, "link", "set", IFNAME, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # a route to everywhere through the host: another site's address is then refused by
        # the host's forwarding rule, not merely missing from the site's table
        _run("ip", "-n", ns, "route", "add", "default", "via", self.store_address(site))
        _run("tc", "qdisc", "add", "dev", host, "root", *_tbf(self.rate_bps))
        inner = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME)
        if self.delay_s > 0:
            try:
                _run(*inner, "root", "handle", "1:", "netem", "delay", f"{self.delay_s * 1e6:.0f}us", "limit", "100000")
            except RuntimeError as err:
                raise RuntimeError(f"a link delay needs the kernel's netem qdisc (sch_netem): {err}") from None
            _run(*inner, "parent", "1:1", "handle", "10:", *_tbf(self.rate_bps))
        else:
            _run(*inner, "root", *_tbf(self.rate_bps))
