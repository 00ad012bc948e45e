"""Before a --site command starts its workers: the sites agree, through the store, that they run
the same thing (`agree`).

Each site writes what every site must share, once, to <URL>/<run>/agreed/<site> (its
config as every site sees it, its optimizers and their learning rates, its --workers and
--peers), then waits for every peer's record (up to the handshake's 600 s) and compares. A
difference is a ValueError at every site naming the fields and each site's value, before any
round is written: the rounds would otherwise reject the other sites' messages (another
fingerprint) and each site could train on alone. A site that finds its own name already holding another record (a run
restarted with the same key) is refused too: the run's rounds belong to the first.
"""

from __future__ import annotations

import json
import sys
import time

from .config import RunOptions, TrainConfig

JOIN_TIMEOUT_S = 600.0          # the handshake's own (StoreGroup.join_timeout): sites start at different times
POLL_S = (0.1, 2.0)             # first and longest wait between listings, doubling


def site_record(cfg: TrainConfig, lrs: dict[str, float], opts: RunOptions, workers: int) -> dict:
    """What every site of a run must share: no local path, nothing of one site's (store_runs.shared_config)."""
    from .store_runs import shared_config
    return {"config": shared_config(cfg), "optimizers": lrs, "workers": workers, "peers": sorted(opts.peers)}


def agree(cfg: TrainConfig, lrs: dict[str, float], opts: RunOptions, workers: int,
               timeout: float = JOIN_TIMEOUT_S) -> None:
    """Write this site's record under the run's folder and wait for every peer's; ValueError
    when one differs. Peers that have not written theirs within `timeout` seconds are named in
    a warning and left out, as the store's handshake leaves them out (they may join later)."""
    from ..store import open_location
    from .store_runs import run_url
    location = open_location(f"{run_url(opts)}/agreed")
    mine = json.dumps(site_record(cfg, lrs, opts, workers), sort_keys=True).encode()
    if not location.put_once(opts.site, mine) and location.get(opts.site) != mine:
        raise ValueError(f"site {opts.site} already agreed to this run ({run_url(opts)}) with other settings: a run "
                         "restarted with the same key finds the first one's rounds; use a fresh key")
    deadline, wait = time.monotonic() + timeout, POLL_S[0]
    while True:
        missing = sorted(set(opts.peers) - set(location.list()))
        if not missing:
            break
        if time.monotonic() > deadline:            # as the store's handshake does: go on, they may join later
            print(f"thinwire: warning: site(s) {', '.join(missing)} did not agree to {run_url(opts)} within "
                  f"{timeout:g} s; starting without them", file=sys.stderr, flush=True)
            break
        time.sleep(wait)
        wait = min(2 * wait, POLL_S[1])
    theirs = {site: json.loads(location.get(site)) for site in opts.peers if site not in (opts.site, *missing)}
    differ = _differences(json.loads(mine), theirs)
    if differ:
        raise ValueError(f"the sites do not run the same thing ({opts.site} against the others): {differ}; "
                         "every site must give the same flags but --site and --out")


def _differences(mine: dict, theirs: dict[str, dict]) -> str:
    """'field (this site: x, b: y)' for every shared field whose value differs at some peer."""
    def flat(record: dict) -> dict:
        config = record["config"]
        return {**{k: v for k, v in record.items() if k != "config"}, **config}
    here, out = flat(mine), []
    others = {site: flat(r) for site, r in theirs.items()}
    for field in sorted(set(here).union(*others.values())):
        values = {site: r.get(field) for site, r in others.items() if r.get(field) != here.get(field)}
        if values:
            out.append(f"{field} (here {here.get(field)!r}, " + ", ".join(f"{s}: {v!r}" for s, v in values.items())
                       + ")")
    return "; ".join(out)
