"""`thinwire train|compare --exchange URL`: each worker a site whose optimizer exchanges its
messages through an object store (`thinwire.store.StoreGroup`) instead of torch.distributed.

    thinwire compare --preset tiny --optimizers demo,sparseloco --exchange file:///tmp/rounds
    thinwire compare --preset wan --optimizers demo --exchange s3://bucket/runs --round-timeout 30

Each run writes its rounds under <URL>/<run id>/<optimizer>/ (the run id from the run's key,
so a URL can hold many runs); the key signing every message is drawn afresh per command. The
optimizer's exchange is all that crosses the store: the harness still starts its workers as one
torch.distributed world on this machine, for evaluation and logging, so this measures the
store exchange on one machine; sites that cannot reach each other run the library
(`process_group=StoreGroup(...)`, README "Across the internet"). An s3:// URL takes its
endpoint and credentials from the AWS_* environment variables (obstore's).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import replace

from .config import RunOptions, TrainConfig
from .optimizers import get_optimizer


def with_key(opts: RunOptions) -> RunOptions:
    """The options with this command's signing key (hex), drawn once, when --exchange is given."""
    if not opts.exchange or opts.exchange_key:
        return opts
    return replace(opts, exchange_key=secrets.token_hex(32))


def check_exchange(cfg: TrainConfig, optimizers: list[str], opts: RunOptions) -> None:
    """ValueError before any worker starts when --exchange cannot run this table."""
    if not opts.exchange:
        return
    if not opts.round_timeout > 0:
        raise ValueError(f"--round-timeout must be > 0 seconds, got {opts.round_timeout}")
    if cfg.sites:
        raise ValueError("--exchange with --sites: FSDP2 inside a site and the store across sites is not supported "
                         "yet; give one of them")
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
    """This worker's `StoreGroup`: site worker-<rank>, the run's rounds under <URL>/<run>/<optimizer>."""
    from ..store import StoreGroup
    key = bytes.fromhex(opts.exchange_key)
    run = "run-" + hashlib.sha256(key).hexdigest()[:12]
    location = f"{opts.exchange.rstrip('/')}/{run}/{optimizer}"
    sites = [f"worker-{r:04d}" for r in range(world)]
    fingerprint = json.dumps({"config": cfg.record(), "optimizer": optimizer, "lr": lr}, sort_keys=True, default=str)
    return StoreGroup(location, sites[rank], sites, key, fingerprint, opts.round_timeout)
