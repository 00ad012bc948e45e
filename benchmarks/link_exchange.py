"""What one step's exchange costs on the emulated link itself, with no compute beside it.

The overlap issue asks whether a step with overlap takes max(compute, link time). "Link
time" at line rate (bytes x 8 / rate) ignores TCP/IP framing, gloo's own messages and the
token bucket's granularity; this measures it: two gloo workers, each in its own network
namespace behind a `tc tbf` link (`thinwire.train.netns.EmulatedLink`, the harness's
`--link`), run the library's `GatherAll` exchange of a message of the given size back to
back, two ways:

    blocking    start, finish, start, finish ...           (a step without overlap)
    pipelined   two in flight: start t+1, then finish t   (DeMo's EARLY_START overlap)

and print seconds per exchange (median and mean over the timed exchanges) beside the
line-rate model. Needs root and iproute2, like `--link`.

    python benchmarks/link_exchange.py --rate 10mbit --bytes 136709 --exchanges 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from thinwire.comm import Communicator
from thinwire.optim.exchange import GatherAll
from thinwire.train.config import parse_rate
from thinwire.train.launch import launch
from thinwire.train.netns import EmulatedLink, available

WARMUP = 5                     # exchanges before timing: TCP's window opens, gloo connects


def _exchanges(comm: Communicator, nbytes: int, count: int, pipelined: bool) -> list[float]:
    """Seconds per exchange, count of them, timed between consecutive finishes."""
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


def _worker(rank: int, world: int, nbytes: int, count: int, results) -> None:
    comm = Communicator()
    for mode, pipelined in (("blocking", False), ("pipelined", True)):
        _exchanges(comm, nbytes, WARMUP, pipelined)
        times = _exchanges(comm, nbytes, count, pipelined)
        if rank == 0:
            results[mode] = times


def measure(rate_bps: float, nbytes: int, count: int) -> dict[str, list[float]]:
    import torch.multiprocessing as mp
    results = mp.get_context("spawn").Manager().dict()
    with EmulatedLink(2, rate_bps) as link:
        launch(_worker, 2, args=(nbytes, count, results), namespaces=link.namespaces, ifname=link.ifname)
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="10mbit", type=parse_rate, help="link rate, e.g. 10mbit, 100mbit")
    parser.add_argument("--bytes", type=int, nargs="+", default=[136_709],
                        help="payload bytes per rank and exchange (136709: DeMo on `wan`)")
    parser.add_argument("--exchanges", type=int, default=60, help="timed exchanges per mode")
    args = parser.parse_args()
    ok, why = available()
    if not ok:
        raise SystemExit(f"link_exchange: {why}")
    rate = args.rate
    torch.set_num_threads(1)
    print("| bytes/rank | line rate s | blocking s: median (mean) | pipelined s: median (mean) |")
    print("|---|---|---|---|")
    for nbytes in args.bytes:
        got = measure(rate, nbytes, args.exchanges)
        cells = [f"{statistics.median(got[m]):.4f} ({statistics.mean(got[m]):.4f})" for m in ("blocking", "pipelined")]
        print(f"| {nbytes} | {nbytes * 8 / rate:.4f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
