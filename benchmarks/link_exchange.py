"""What one step's exchange costs on the emulated link itself, with no compute beside it.

The overlap issue asks whether a step with overlap takes max(compute, link time). "Link
time" at line rate (bytes x 8 / rate) ignores TCP/IP framing, gloo's own messages and the
token bucket's granularity; this measures it: two gloo workers, each in its own network
namespace behind a `tc tbf` link (`thinwire.train.netns.EmulatedLink`, the harness's
`--link`), run the library's `GatherAll` exchange of a message of the given size back to
back, two ways:

    blocking    start, finish, start, finish ...           (a step without overlap)
    pipelined   two in flight: start t+1, then finish t   (DeMo's EARLY_START overlap)

and print seconds per exchange (median, mean and max over the timed exchanges) beside the
line-rate model. Needs root and iproute2, like `--link`.

`--gap S` idles S seconds before each blocking exchange, as training leaves its message
every few steps, and times each from its start; `--max-parts 1 4` measures with `GatherAll`
gathering a message in one all_gather and in up to four (`exchange.MAX_PARTS`, set in the
workers; the library's default is 4).

    python benchmarks/link_exchange.py --rate 10mbit --bytes 136709 --exchanges 60
    python benchmarks/link_exchange.py --rate 10mbit --bytes 129056 --gap 0.15 --max-parts 1 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from thinwire.comm import Communicator
from thinwire.optim import exchange
from thinwire.optim.exchange import GatherAll
from thinwire.train.config import parse_rate
from thinwire.train.launch import launch
from thinwire.train.netns import EmulatedLink, available

WARMUP = 5                     # exchanges before timing: TCP's window opens, gloo connects


def _exchanges(comm: Communicator, nbytes: int, count: int, pipelined: bool, gap: float = 0.0) -> list[float]:
    """Seconds per exchange, count of them, timed between consecutive finishes (after an idle
    `gap`, blocking only: from its start)."""
    if gap:
        return _after_gaps(comm, nbytes, count, gap)
    messages = [GatherAll(comm), GatherAll(comm)]
    for message in messages:
        message.resize(1, nbytes, "cpu").fill_(7)
    finished = []
    if pipelined:
        messages[1].seal(1, 0, [True])                     # step s travels in messages[s % 2]
        messages[1].start()
    for step in range(1, count + 1):
        current = messages[step % 2]
        if pipelined:                                       # the next one leaves before this one lands
            following = messages[(step + 1) % 2]
            following.seal(step + 1, 0, [True])
            following.start()
            current.finish(step)
        else:
            current.seal(step, 0, [True])
            current.start()
            current.finish(step)
        finished.append(time.perf_counter())
    if pipelined:
        messages[(count + 1) % 2].finish(count + 1)
    return [b - a for a, b in zip(finished, finished[1:])]


def _after_gaps(comm: Communicator, nbytes: int, count: int, gap: float) -> list[float]:
    """Seconds from start to finish of each of `count` exchanges, each after a barrier and an
    idle `gap` (the link drained, as between two syncs)."""
    message, times = GatherAll(comm), []
    message.resize(1, nbytes, "cpu").fill_(7)
    for step in range(1, count + 1):
        dist.barrier()
        time.sleep(gap)
        start = time.perf_counter()
        message.seal(step, 0, [True])
        message.start()
        message.finish(step)
        times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, world: int, nbytes: int, count: int, gap: float, max_parts: int, results) -> None:
    exchange.MAX_PARTS = max_parts                     # this worker's GatherAll, for the comparison
    comm = Communicator()
    for mode, pipelined in (("blocking", False), ("pipelined", True)):
        _exchanges(comm, nbytes, WARMUP, pipelined, gap if not pipelined else 0.0)
        times = _exchanges(comm, nbytes, count, pipelined, gap if not pipelined else 0.0)
        if rank == 0:
            results[mode] = times


def measure(rate_bps: float, nbytes: int, count: int, gap: float = 0.0,
            max_parts: int = exchange.MAX_PARTS) -> dict[str, list[float]]:
    import torch.multiprocessing as mp
    results = mp.get_context("spawn").Manager().dict()
    with EmulatedLink(2, rate_bps) as link:
        launch(_worker, 2, args=(nbytes, count, gap, max_parts, results), namespaces=link.namespaces,
               ifname=link.ifname)
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="10mbit", type=parse_rate, help="link rate, e.g. 10mbit, 100mbit")
    parser.add_argument("--bytes", type=int, nargs="+", default=[136_709],
                        help="payload bytes per rank and exchange (136709: DeMo on `wan`)")
    parser.add_argument("--exchanges", type=int, default=60, help="timed exchanges per mode")
    parser.add_argument("--gap", type=float, default=0.0,
                        help="idle seconds before each blocking exchange, timed from its start (default 0: back to back)")
    parser.add_argument("--max-parts", type=int, nargs="+", default=[exchange.MAX_PARTS],
                        help="GatherAll's most all_gathers per message, one measurement each (default: the library's)")
    args = parser.parse_args()
    ok, why = available()
    if not ok:
        raise SystemExit(f"link_exchange: {why}")
    rate = args.rate
    torch.set_num_threads(1)
    print(f"gap before each blocking exchange: {args.gap} s")
    print("| bytes/rank | most parts | line rate s | blocking s: median (mean, max) | pipelined s: median (mean, max) |")
    print("|---|---|---|---|---|")
    for nbytes in args.bytes:
        for parts in args.max_parts:
            got = measure(rate, nbytes, args.exchanges, args.gap, parts)
            cells = [f"{statistics.median(got[m]):.4f} ({statistics.mean(got[m]):.4f}, {max(got[m]):.4f})"
                     for m in ("blocking", "pipelined")]
            print(f"| {nbytes} | {parts} | {nbytes * 8 / rate:.4f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
