"""`thinwire train|compare --exchange URL`: each worker a site whose optimizer exchanges its
messages through an object store (`thinwire.store.StoreGroup`) instead of torch.distributed.

    thinwire compare --preset tiny --optimizers demo,sparseloco --exchange file:///tmp/rounds
    thinwire compare --preset wan --optimizers demo --exchange s3://bucket/runs --round-timeout 30

Each run writes its rounds under <URL>/<run id>/<optimizer>/ (the run id from the run's key,
so a URL can hold many runs); the key signing every message is drawn afresh per command unless
given (THINWIRE_EXCHANGE_KEY, --exchange-key-file). One command: the optimizer's exchange is all
that crosses the store, its workers are still one torch.distributed world on this machine, for
evaluation and logging. With --site NAME --peers A,B each site is its own command sharing only
the store (train/site_run.py). An s3:// URL takes its endpoint and credentials from the AWS_*
environment variables (obstore's).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import replace

from .config import RunOptions, TrainConfig
from .optimizers import get_optimizer
from .site_join import check_join
from .site_run import check_site, participant, participants, read_key, site_options


def with_key(opts: RunOptions) -> RunOptions:
    """The options with the run's signing key (hex) when --exchange is given: the one given
    (THINWIRE_EXCHANGE_KEY, --exchange-key-file: site_run.read_key), else drawn once here."""
    opts = read_key(opts)
    if not opts.exchange or opts.exchange_key:
        return opts
    return replace(opts, exchange_key=secrets.token_hex(32))


def torchrun_site(cfg, optimizer: str, opts: RunOptions, world: int) -> RunOptions:
    """Under torchrun, --exchange: the torchrun world is one site's workers (--site NAME --peers
    A,B,...; its nodes reach each other, the sites only the store), checked as the local
    launcher checks it, with the key every rank reads alike (THINWIRE_EXCHANGE_KEY or
    --exchange-key-file: ranks cannot share one drawn here). ValueError when it cannot run."""
    if not opts.site:
        raise ValueError("--exchange under torchrun runs one site of a store run: give --site NAME and --peers "
                         "A,B,... (the torchrun world is that site's workers)")
    check_site(opts, world, cfg.sites)
    opts = read_key(opts)
    check_exchange(cfg, [optimizer], opts)
    check_join(opts, [optimizer])
    return site_options(opts)


def check_exchange(cfg: TrainConfig, optimizers: list[str], opts: RunOptions) -> None:
    """ValueError before any worker starts when --exchange cannot run this table."""
    if not opts.exchange:
        return
    if not opts.round_timeout > 0:
        raise ValueError(f"--round-timeout must be > 0 seconds, got {opts.round_timeout}")
    from urllib.parse import urlparse
    if urlparse(opts.exchange).scheme not in ("file", "s3"):
        raise ValueError(f"--exchange must be a file:///folder or s3://bucket/prefix URL, got {opts.exchange!r}")
    for name in optimizers:
        reason = _why_not(name, cfg)
        if reason:
            raise ValueError(f"--exchange: {reason}")


def _why_not(name: str, cfg: TrainConfig) -> str:
    """Why optimizer `name` cannot take the store ("" when it can): a torch baseline, or a
    thinwire optimizer that cannot keep a message that misses a round (`STORE_EXCHANGE`)."""
    import torch
    from .model import build_model
    spec = get_optimizer(name)
    if spec.dense or spec.settings is None or name == "powersgd":
        return f"{name} is a torch.distributed baseline; the store exchange is a thinwire optimizer's"
    with torch.device("meta"):
        opt = spec.build(build_model(cfg), cfg, 1e-3).optimizer
    if not getattr(opt, "STORE_EXCHANGE", False):
        return (f"{name} cannot keep a message that misses a store round (DeMo, SignDeMo, SparseLoCo and DiLoCo "
                "with a lossy wire can: docs/design.md, 'The store exchange')")
    return ""


def store_group(opts: RunOptions, cfg: TrainConfig, optimizer: str, lr: float, rank: int, world: int):
    """This worker's `StoreGroup` (`rank`, `world`: this command's gloo world): participant
    worker-<rank>, or <site>.<rank> under --site (site_run.py); the run's rounds under
    <URL>/<run>/<optimizer>. The fingerprint holds what every site must share (the config, the
    optimizer, its lr, the participants) and nothing of one site's, so sites that agree on the
    run sign the same one and a site given other --peers is left out of every round."""
    from ..store import StoreGroup
    key = bytes.fromhex(opts.exchange_key)
    location = f"{run_url(opts)}/{optimizer}"
    sites = participants(opts, world)
    fingerprint = json.dumps({"config": shared_config(cfg), "optimizer": optimizer, "lr": lr, "participants": sites},
                             sort_keys=True, default=str)
    return StoreGroup(location, participant(opts, rank), sites, key, fingerprint, opts.round_timeout,
                      join_timeout=opts.join_timeout)


def shard_store_group(opts: RunOptions, cfg: TrainConfig, optimizer: str, lr: float, site: int, shard: int):
    """The `StoreGroup` of shard `shard` of site `site` under --sites with --exchange: FSDP2 shards
    the model inside each site, and shard k of every site exchanges with shard k of the others
    through its own rounds under <URL>/<run>/<optimizer>/shard-<k> (the store's counterpart of
    the mesh's site group of rank k). Participants are the sites, in the order of the sites'
    ranks: site-<s> in one command, the sorted --peers under --site."""
    from ..store import StoreGroup
    sites = sorted(opts.peers) if opts.site else [f"site-{s:03d}" for s in range(cfg.sites)]
    location = f"{run_url(opts)}/{optimizer}/shard-{shard:03d}"
    fingerprint = json.dumps({"config": shared_config(cfg), "optimizer": optimizer, "lr": lr, "participants": sites,
                              "shard": shard}, sort_keys=True, default=str)
    key = bytes.fromhex(opts.exchange_key)
    return StoreGroup(location, sites[site], sites, key, fingerprint, opts.round_timeout,
                      join_timeout=opts.join_timeout)


def run_url(opts: RunOptions) -> str:
    """The run's folder: <URL>/run-<the first 12 hex of the key's SHA-256>, so a URL holds many runs."""
    return f"{opts.exchange.rstrip('/')}/run-{hashlib.sha256(bytes.fromhex(opts.exchange_key)).hexdigest()[:12]}"


def shared_config(cfg: TrainConfig) -> dict:
    """cfg's record as every site sees it: local paths do not enter it (--init-from's folder is
    left out, a --model config.json enters as its contents' SHA-256), so sites that keep the
    same files in different places still share one fingerprint."""
    record = dict(cfg.record())
    record.pop("init_from", None)
    if cfg.model.endswith(".json"):
        with open(cfg.model, "rb") as f:
            record["model"] = "sha256:" + hashlib.sha256(f.read()).hexdigest()
    return record
