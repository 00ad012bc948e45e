"""Sites as separate OS processes, each with its own RoundExchange on a shared location.

    results = run_sites(url, options, plans, sites=[...], round_timeout=2.0)
    results["site-a"][r]  # the RoundResult site-a got for round r

Each process opens the location itself (no state is shared with the test process but the
store), waits at a barrier so that all start together, then follows its plan: a list of
steps `(round, action, sleep_before_s)` with action 'exchange' (publish, wait, agree) or
'race' (publish, wait for every site at a barrier, then close the round at once through a
location that pauses before writing a manifest, so that every site lists the round before
any writes: a real race for the conditional create). Processes come from the test suite's
usual start method (a forkserver that has imported torch, else spawn).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback

from thinwire.store import Location, RoundExchange, open_location
from thinwire.train.launch import start_method

KEY = b"the run's shared HMAC key"
CONFIG = '{"model": "tiny", "optimizer": "demo", "seed": 0}'
MANIFEST_PAUSE_S = 0.5


def payload_for(site: str, round: int) -> bytes:
    """A site's message for a round: distinct bytes per site and round."""
    return f"{site} round {round} ".encode() * (round + 1)


class HesitantLocation(Location):
    """Another location's objects, pausing before each manifest write (the race test)."""

    def __init__(self, inner: Location) -> None:
        super().__init__()
        self.inner, self.url = inner, inner.url

    def check(self) -> None:
        self.inner.check()

    def _put_once(self, key: str, data: bytes) -> bool:
        if key.endswith("/manifest"):
            time.sleep(MANIFEST_PAUSE_S)
        return self.inner._put_once(key, data)

    def _get(self, key: str):
        return self.inner._get(key)

    def _list(self, folder: str):
        return self.inner._list(folder)


def _follow(exchange: RoundExchange, plan, barrier) -> dict:
    results = {}
    for round, action, sleep_before_s in plan:
        time.sleep(sleep_before_s)
        payload = payload_for(exchange.site, round)
        if action == "exchange":
            results[round] = exchange.exchange(round, payload)
        else:
            exchange.publish(round, payload)
            barrier.wait(timeout=60)
            results[round] = exchange.close(round)
    return results


def _site_main(url, options, site, sites, plan, round_timeout, barrier, out) -> None:
    try:
        location = open_location(url, **options)
        if any(action == "race" for _, action, _ in plan):
            location = HesitantLocation(location)
        exchange = RoundExchange(location, site, sites, KEY, CONFIG, round_timeout, poll=(0.02, 0.2))
        barrier.wait(timeout=120)
        out.put((site, "ok", _follow(exchange, plan, barrier)))
    except BaseException:
        out.put((site, "error", traceback.format_exc()))


def run_sites(url: str, options: dict, plans: dict, sites: list[str], round_timeout: float,
              timeout: float = 180.0) -> dict:
    """Run one process per entry of `plans` (site -> plan); {site: {round: RoundResult}}."""
    ctx = mp.get_context(start_method())
    barrier, out = ctx.Barrier(len(plans)), ctx.Queue()
    procs = [ctx.Process(target=_site_main, args=(url, options, site, sites, plan, round_timeout, barrier, out))
             for site, plan in plans.items()]
    for proc in procs:
        proc.start()
    results, errors = {}, []
    try:
        for _ in procs:
            site, status, value = out.get(timeout=timeout)
            if status == "ok":
                results[site] = value
            else:
                errors.append(f"{site}:\n{value}")
    except queue.Empty:
        errors.append(f"sites did not answer within {timeout} s (have {sorted(results)})")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert not errors, "\n".join(errors)
    return results
