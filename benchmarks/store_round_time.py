"""How long one round of the store exchange takes over slow links, beside gloo's all_gather.

Sites are real processes, each in its own network namespace joined only to the host by a link
of the given rate (`thinwire.train.netns_isolated.IsolatedSites`: no route between sites); an
S3-API server (moto's, as tests/store use it, with PutObject made atomic) listens in the host
namespace. Each site runs `RoundExchange.exchange` back to back with a payload of the size one
optimizer message has, and the tables give, per payload:

    round s       seconds between a site's consecutive round answers (mean, median, p90;
                  every site's timed rounds pooled): the mean is 1 / the rounds per second
    puts/gets/lists, kB written/read   requests and object bytes per round per site, means
                  (`RoundResult.traffic`, `StoreTraffic`)
    list ms       one LIST request's latency from a site (median of 10 before the rounds)
    wire s        the objects' bytes at line rate: what a site uploads (its message, plus
                  the manifest when it closes) and downloads (the others' messages), in sequence
    gloo s        the same payload's all_gather between as many ranks in `EmulatedLink` at the
                  same rate (GatherAll, back to back: benchmarks/link_exchange.py's timing)

and the file:// store on this machine (no network, no shaping) as the floor. Payloads are
the per-message bytes of DeMo (every step) and SparseLoCo (every sync) on the presets, measured
by building each preset's model and optimizer in a world of one and stepping until its first
message is counted (`comm_stats.by_tag['payload']`: what `thinwire compare` reports as
payload_bytes). Needs root, iproute2, obstore and moto[server]. Not a test.

    python benchmarks/store_round_time.py --sites 2 --rates 100mbit 10mbit
    python benchmarks/store_round_time.py --sites 4 --rates 10mbit --no-gloo
    python benchmarks/store_round_time.py --sites 2 --rates 10mbit --poll 0.01 0.1 --no-gloo --no-file
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid

import torch.multiprocessing as mp

from link_exchange import WARMUP, _exchanges

PRESETS, OPTIMIZERS = ("tiny", "wan", "small"), ("demo", "sparseloco")
CREDENTIALS = {"access_key_id": "bench", "secret_access_key": "bench", "region": "us-east-1"}
KEY = b"store-round-time-benchmark-key"


def _probe(rank: int, world: int, pairs, out) -> None:
    """Each (preset, optimizer)'s message bytes: step on random gradients until one is sent."""
    import torch
    from thinwire.train.config import PRESETS as CONFIGS
    from thinwire.train.model import build_model
    from thinwire.train.optimizers import get_optimizer, learning_rate
    for preset, name in pairs:
        cfg = CONFIGS[preset]
        model = build_model(cfg)
        opt = get_optimizer(name).build(model, cfg, learning_rate(cfg, name)).optimizer
        sent = opt.comm_stats.by_tag
        while "payload" not in sent:
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        out[(preset, name)] = sent["payload"].payload_bytes


def payload_sizes() -> dict[tuple[str, str], int]:
    from thinwire.train.launch import launch
    out = mp.get_context("spawn").Manager().dict()
    launch(_probe, 1, args=([(p, o) for p in PRESETS for o in OPTIMIZERS], out))
    return {k: out[k] for k in sorted(out, key=lambda k: out[k])}


def start_s3():
    """A moto S3 server on every host address, PutObject check-then-write made one step as on
    S3 (the same patch as tests/store/conftest.py); returns (server, port)."""
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    original, lock = S3Response.put_object, threading.Lock()

    def put_object(self):
        with lock:
            return original(self)

    S3Response.put_object = put_object
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=0, verbose=False)
    server.start()
    return server, server.get_host_and_port()[1]


def make_bucket(port: int) -> str:
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/{bucket}", method="PUT"), timeout=30).close()
    return bucket


def _site(index: int, sites: int, namespace: str | None, cases, options: dict, rounds: int, warmup: int,
          poll: tuple[float, float], out) -> None:
    """One site: for each (label, url, nbytes), warm-up plus timed rounds back to back; records
    per timed round (seconds since the previous answer, traffic) and LIST latencies."""
    if namespace:
        from thinwire.train.netns import enter_namespace
        enter_namespace(namespace)                 # before obstore starts its threads
    from thinwire.store import RoundExchange
    names = [f"site-{s}" for s in range(sites)]
    for label, url, nbytes in cases:
        ex = RoundExchange(url, names[index], names, KEY, f"bench {label}", round_timeout=120.0, poll=poll,
                           options=options)
        list_s = []
        for _ in range(10):
            start = time.perf_counter()
            ex.location.list("rounds/9999999999")
            list_s.append(time.perf_counter() - start)
        payload, got, last = os.urandom(nbytes), [], None
        for r in range(warmup + rounds):
            result = ex.exchange(r, payload)
            assert result.included and len(result.messages) == sites, (label, r, result.late)
            now = time.perf_counter()
            if r >= warmup:
                got.append((now - last, result.traffic.as_dict(), result.closed_here))
            last = now
        out[(index, label)] = (got, list_s)


def run_sites(sites: int, namespaces, cases_for, options_for, rounds, warmup, poll) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=_site, args=(i, sites, namespaces[i] if namespaces else None, cases_for(i),
                                               options_for(i), rounds, warmup, poll, out))
             for i in range(sites)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"a site exited with {proc.exitcode}")
    return dict(out)


def _gloo_worker(rank: int, world: int, sizes, count: int, out) -> None:
    from thinwire.comm import Communicator
    comm = Communicator()
    for nbytes in sizes:
        _exchanges(comm, nbytes, WARMUP, False)
        times = _exchanges(comm, nbytes, count + 1, False)
        if rank == 0:
            out[nbytes] = times


def gloo_times(world: int, rate_bps: float, sizes, count: int) -> dict[int, list[float]]:
    from thinwire.train.launch import launch
    from thinwire.train.netns import EmulatedLink
    out = mp.get_context("spawn").Manager().dict()
    with EmulatedLink(world, rate_bps) as link:
        launch(_gloo_worker, world, args=(sizes, count, out), namespaces=link.namespaces, ifname=link.ifname)
    return dict(out)


def _p(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(got: dict, sites: int, label: str) -> dict:
    """Pooled over sites: round seconds, mean requests and kB per round, LIST ms."""
    rows = [row for s in range(sites) for row in got[(s, label)][0]]
    rounds = [r[0] for r in rows]
    mean = {k: statistics.mean(r[1][k] for r in rows) for k in ("puts", "gets", "lists", "bytes_written", "bytes_read")}
    lists = [x for s in range(sites) for x in got[(s, label)][1]]
    return {"mean": statistics.mean(rounds), "median": statistics.median(rounds), "p90": _p(rounds, 0.9), **mean,
            "list_ms": 1e3 * statistics.median(lists)}


def wire_s(sites: int, nbytes: int, rate_bps: float) -> float:
    """A site's upload of its message and download of the others' at line rate, in sequence
    (envelopes and the manifest left out)."""
    return sites * nbytes * 8 / rate_bps


def table(title: str, sizes: dict, got: dict, sites: int, rate_bps: float | None, gloo: dict | None) -> None:
    print(f"\n{title}\n")
    print("| payload | bytes | round s: mean | median | p90 | puts | gets | lists | kB written | kB read "
          "| list ms | wire s | gloo all_gather s: median | p90 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (preset, opt), nbytes in sizes.items():
        s = summary(got, sites, f"{preset}-{opt}")
        wire = f"{wire_s(sites, nbytes, rate_bps):.4f}" if rate_bps else "-"
        g = gloo.get(nbytes) if gloo else None
        gl = f"{statistics.median(g):.4f} | {_p(g, 0.9):.4f}" if g else "- | -"
        print(f"| {opt} {preset} | {nbytes} | {s['mean']:.3f} | {s['median']:.3f} | {s['p90']:.3f} | {s['puts']:.2f} "
              f"| {s['gets']:.2f} | {s['lists']:.2f} | {s['bytes_written'] / 1e3:.1f} | {s['bytes_read'] / 1e3:.1f} "
              f"| {s['list_ms']:.1f} | {wire} | {gl} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "10mbit"], help="link rates, e.g. 100mbit 10mbit")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per payload")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before timing (start skew, TCP windows)")
    parser.add_argument("--poll", type=float, nargs=2, default=(0.05, 1.0), help="RoundExchange's poll (first, longest)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the gloo comparison")
    parser.add_argument("--no-file", action="store_true", help="skip the file:// floor")
    args = parser.parse_args()
    if args.sites < 2:
        raise ValueError(f"--sites must be >= 2, got {args.sites}")
    from thinwire.train.config import parse_rate
    from thinwire.train.netns_isolated import IsolatedSites
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    sizes = payload_sizes()
    print("message bytes (payload):", {f"{o} {p}": n for (p, o), n in sizes.items()})
    common = dict(rounds=args.rounds, warmup=args.warmup, poll=tuple(args.poll))
    if not args.no_file:
        with tempfile.TemporaryDirectory() as root:
            cases = [(f"{p}-{o}", f"file://{root}/{p}-{o}", n) for (p, o), n in sizes.items()]
            got = run_sites(args.sites, None, lambda i: cases, lambda i: {}, **common)
        table(f"file:// on this machine, {args.sites} sites (the floor: no network)", sizes, got, args.sites, None, None)
    server, port = start_s3()
    try:
        for rate in args.rates:
            rate_bps = parse_rate(rate)
            bucket = make_bucket(port)
            cases = [(f"{p}-{o}", f"s3://{bucket}/{p}-{o}", n) for (p, o), n in sizes.items()]
            with IsolatedSites(args.sites, rate_bps) as net:
                options = lambda i: {"endpoint": f"http://{net.store_address(i)}:{port}", **CREDENTIALS}  # noqa: E731
                got = run_sites(args.sites, net.namespaces, lambda i: cases, options, **common)
            gloo = None if args.no_gloo else gloo_times(args.sites, rate_bps, list(sizes.values()), args.rounds)
            table(f"s3:// (moto) in the host namespace, {args.sites} isolated sites at {rate}, poll {tuple(args.poll)}",
                  sizes, got, args.sites, rate_bps, gloo)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
