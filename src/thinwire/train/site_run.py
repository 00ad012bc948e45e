"""One site per command: `thinwire train --exchange URL --site NAME --peers A,B --workers N`.

    THINWIRE_EXCHANGE_KEY=<hex> thinwire train --preset tiny --workers 2 \\
        --exchange s3://bucket/runs --site a --peers a,b --out runs/a        # at site a
    THINWIRE_EXCHANGE_KEY=<hex> thinwire train --preset tiny --workers 2 \\
        --exchange s3://bucket/runs --site b --peers a,b --out runs/b        # at site b

Each command starts its site's N workers as a gloo world of their own on this machine
(127.0.0.1, a rendezvous file: nothing crosses to another site), used only inside the site:
evaluation split over its ranks, its log, its replica check. Across sites only the store
carries anything: every worker is its own store participant "<site>.<k:03d>", and the
participants of every site, sorted, give the global ranks (rank = index in the sorted list,
world = sites x N) that shard the data. So S sites of N workers compute what one S x N
worker gloo run computes, to the last bit when no round is missed.

Every site must be given the same signing key (a key drawn per command would differ): from
THINWIRE_EXCHANGE_KEY (hex) or --exchange-key-file (a file holding the hex key). The run id
(the store folder) derives from the key, the fingerprint from the config and the participants.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from .config import RunOptions

KEY_ENV = "THINWIRE_EXCHANGE_KEY"
MIN_KEY_BYTES = 16                  # 128 bits: shorter is guessable, and HMAC's strength is the key's
MAX_WORKERS = 1000                  # the participant id numbers a site's workers with 3 digits


def participants(opts: RunOptions, world: int) -> list[str]:
    """Every store participant of the run, sorted: the position is the global rank. One command
    (no --site): worker-<rank>; per site: <site>.<k> for every site in --peers, k < `world`."""
    if not opts.site:
        return [f"worker-{r:04d}" for r in range(world)]
    return sorted(f"{site}.{k:03d}" for site in opts.peers for k in range(world))


def participant(opts: RunOptions, rank: int) -> str:
    """This worker's participant id (`rank`: its rank in the local gloo world)."""
    return f"{opts.site}.{rank:03d}" if opts.site else f"worker-{rank:04d}"


def global_rank(opts: RunOptions, rank: int, world: int) -> tuple[int, int]:
    """(rank, world) of this worker across the run: what shards the data and names its store rows."""
    everyone = participants(opts, world)
    return everyone.index(participant(opts, rank)), len(everyone)


def run_world(opts: RunOptions, workers: int) -> int:
    """Workers across the run: this command's, times the sites under --site."""
    return workers * len(opts.peers) if opts.site else workers


def read_key(opts: RunOptions) -> RunOptions:
    """The options with the signing key: given (the library), from THINWIRE_EXCHANGE_KEY, from
    --exchange-key-file; without --site and none given, the caller draws one per command."""
    if not opts.exchange:
        return opts
    key, source = opts.exchange_key, "exchange_key"
    if not key and os.environ.get(KEY_ENV):
        key, source = os.environ[KEY_ENV].strip(), KEY_ENV
    if not key and opts.exchange_key_file:
        try:
            with open(opts.exchange_key_file) as f:
                key, source = f.read().strip(), "--exchange-key-file"
        except OSError as err:
            raise ValueError(f"--exchange-key-file: cannot read {opts.exchange_key_file}: {err.strerror}") from None
    if not key:
        if opts.site:
            raise ValueError(f"--site needs the run's signing key, the same at every site: set {KEY_ENV} to its "
                             "hex or give --exchange-key-file PATH (make one with: python -c \"import secrets; "
                             "print(secrets.token_hex(32))\"); a key drawn here would differ from the other sites'")
        return opts
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raise ValueError(f"{source}: the signing key must be hex digits") from None
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(f"{source}: the signing key must have at least {MIN_KEY_BYTES} bytes "
                         f"({2 * MIN_KEY_BYTES} hex digits), got {len(raw)}")
    return replace(opts, exchange_key=key)


def check_site(opts: RunOptions, workers: int, sites: int = 0) -> None:
    """ValueError, before any worker starts, when --site/--peers cannot run (`sites`: --sites,
    which under --site must count the --peers); what any --exchange run needs (a thinwire
    optimizer) store_runs.check_exchange checks."""
    from ..store.manifest import check_site as valid_id
    if not opts.site:
        if opts.peers:
            raise ValueError("--peers names the sites of a --site run: give --site too")
        return
    if not opts.exchange:
        raise ValueError("--site runs one site of a run whose sites share only a store: give --exchange URL")
    if len(opts.peers) < 1 or len(set(opts.peers)) != len(opts.peers):
        raise ValueError(f"--peers must name every site of the run once, got {','.join(opts.peers)!r}")
    for name in (opts.site, *opts.peers):
        try:
            valid_id(f"{name}.000")
        except ValueError:
            raise ValueError(f"--site/--peers: {name!r} is not a site name (letters, digits, '.', '_', '-'; "
                             "not starting with '.'; at most 60)") from None
    if opts.site not in opts.peers:
        raise ValueError(f"--site {opts.site} is not one of --peers {','.join(opts.peers)} (--peers lists every "
                         "site of the run, this one included, the same at every site)")
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be 1 .. {MAX_WORKERS} with --site, got {workers}")
    if opts.link:
        raise ValueError("--link emulates links between this command's workers; with --site they share a "
                         "machine and only the store crosses sites (run the site behind the real or emulated link)")
    if sites and sites != len(opts.peers):
        raise ValueError(f"--sites with --site counts the run's sites: give --sites {len(opts.peers)} (one per "
                         "--peers) to shard each site's workers with FSDP2, or leave it out")
    if opts.checkpoint_every:
        raise ValueError("--checkpoint-every with --site is not supported yet: a site resumed alone would not "
                         "rejoin the store's rounds where it left them")


def site_options(opts: RunOptions) -> RunOptions:
    """What a site run changes in its options: no checkpoints (a site resumed alone would not
    rejoin the rounds where it left them), and gloo on the loopback interface unless told
    otherwise (GLOO_SOCKET_IFNAME): the site's world is local, whatever routes the machine has."""
    return replace(opts, checkpoint=False) if opts.site else opts


def local_ifname(opts: RunOptions) -> str | None:
    """The interface of a site's local gloo world: Linux's loopback, unless GLOO_SOCKET_IFNAME is set."""
    if opts.site and "GLOO_SOCKET_IFNAME" not in os.environ and sys.platform.startswith("linux"):
        return "lo"
    return None


def site_summary(opts: RunOptions, workers: int) -> dict | None:
    """summary.json's "site": which site this command ran, and the run's sites."""
    if not opts.site:
        return None
    everyone = participants(opts, workers)
    return {"site": opts.site, "peers": list(opts.peers), "workers_per_site": workers,
            "global_ranks": [everyone.index(participant(opts, k)) for k in range(workers)]}


def store_record(group) -> dict:
    """One participant's account of the store: the rounds it took part in, those whose manifest
    left its message out (and why), those that closed without another participant, its traffic."""
    results = group.results
    return {"participant": group.rounds.site, "rounds": len(results),
            "missed_rounds": {str(r.round): r.missed_because for r in results if not r.included},
            "rounds_closed_without_others": [r.round for r in results if r.late],
            "waited_s": sum(r.waited_s for r in results), "traffic": group.rounds.location.traffic.as_dict()}


def gather_store(mine: dict, world: int) -> dict:
    """The final record's "store": every local worker's `store_record` (an uncounted harness
    all-gather inside the site), and their traffic summed."""
    import torch.distributed as dist
    everyone = [mine] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    total = {k: sum(p["traffic"][k] for p in everyone) for k in mine["traffic"]}
    return {"participants": everyone, "traffic": total,
            "missed_rounds": sum(len(p["missed_rounds"]) for p in everyone)}
