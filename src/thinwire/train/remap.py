"""A checkpoint of W ranks loaded by W' != W ranks: checkpoint.load's half of an elastic
resume (train/elastic.py announces it).

    sites, per_site = layout(world, cfg.sites)              # a flat run: W sites of 1 rank
    old = peers(rank, old_sites, per_site)                  # the old ranks this rank maps from
    blob = new_rank_blob(blobs, built, rank, world, seed, step, per_site)   # blobs[i]: old rank old[i]'s "rank{..}"
    how = rule(built, old_world, world, old_sites, sites)   # the mapping in words

Flat layout: every new rank reads every old rank's "rank{i}" blob (DCP lets any rank load any
key). Two tiers (`--sites`, train/sites.py): the number of sites may change, the ranks per
site P may not (checkpoint.check refuses another P, naming both). Rank r is (site r // P,
shard r % P) and shard position s holds the same FSDP2 shard in both layouts, so new rank
(j, s) reads the old ranks (i, s), one per old site: exactly the cross-site group its
optimizer's state is relative to. A flat run is the case P = 1 (W sites of one rank, the
optimizer's group the world). From those blobs each new rank builds the one it would have
saved itself:
  * its optimizer state: `thinwire.optim.elastic.remap` of the old peers' states (the
    interval rule over sites: new site j = Σ_i A[j, i] × old site i, A = `mixing_weights(S, S')`;
    flat: over ranks); a torch optimizer's state (saved under "optim": the same on every rank
    under DDP, DTensors under HSDP) is loaded, and re-sharded, by DCP as it is;
  * its own parameters (under --sites its shard), where replicas drift between syncs (LoRDO,
    DiLoCo): mixed by the same rule (`mix`), so the mean of the replicas, what the next sync
    reads, is unchanged;
  * the LR schedule: its first old peer's (it is the same on every rank);
  * the RNG: old rank r's (r: this rank's global rank) when there was a rank r, else a
    generator seeded by `rng_seed(seed, step, r)` (the run's seed, the step resumed at, r);
  * its `extra` (the loop's per-rank byte history): old rank r's, else zeros for the steps it
    did not run (its site did not exist then; the busiest site's sums are unchanged).
The model ("model", one replica; FSDP2 shards under --sites) is re-loaded, and re-sharded, by
DCP as it is.
"""

from __future__ import annotations

import torch

from ..optim.base import CommunicatingOptimizer
from ..optim.elastic import mix, mixing_weights, remap


def rng_seed(seed: int, step: int, rank: int) -> int:
    """The CPU RNG seed of a new rank that had no old counterpart."""
    return (seed * 1_000_003 + step) * 65_537 + rank


def _fmt(a: torch.Tensor) -> str:
    return "[" + ", ".join("[" + ", ".join(f"{x:.3g}" for x in row.tolist()) + "]" for row in a) + "]"


def layout(world: int, sites: int) -> tuple[int, int]:
    """(sites, ranks per site) of a run of `world` ranks with `--sites sites` (0: flat, whose
    optimizer's group is the world: W sites of one rank each)."""
    return (sites, world // sites) if sites else (world, 1)


def layout_text(world: int, sites: int) -> str:
    """'2 sites x 2 ranks' (--sites), '4 workers' (flat)."""
    if not sites:
        return f"{world} workers"
    per = world // sites
    return f"{sites} site{'s' * (sites != 1)} x {per} rank{'s' * (per != 1)}"


def peers(rank: int, old_sites: int, per_site: int) -> list[int]:
    """The old ranks new rank `rank` maps its state from: those that held its shard (position
    rank % per_site), one per old site in site order; flat (per_site 1): every old rank."""
    return [i * per_site + rank % per_site for i in range(old_sites)]


def rule(built, old_world: int, world: int, old_sites: int = 0, sites: int = 0) -> str:
    """How this run maps per-rank state from `old_world` ranks to `world`, in words."""
    if not built.per_rank_state:
        return ("the optimizer state is the same on every rank (a torch optimizer under DDP): loaded as it is"
                if not sites else "the optimizer state is FSDP2 HSDP's, replicated across sites: re-sharded by DCP")
    if not sites:
        text = (f"per-rank optimizer state mapped by the interval rule, new rank j = sum_i A[j, i] x old rank i "
                f"with A = {_fmt(mixing_weights(old_world, world))}")
    else:
        text = ("per-rank optimizer state mapped across sites, shard by shard, by the interval rule: the rank of new "
                "site j holding shard s = sum_i A[j, i] x the rank of old site i holding shard s, with A = "
                f"{_fmt(mixing_weights(old_sites, sites))}")
    return text + (" (each rank's own parameters too)" if built.replicas_drift else "")


def new_rank_blob(blobs: list[dict], built, rank: int, world: int, seed: int, step: int, per_site: int = 1) -> dict:
    """New rank `rank`'s blob (module docstring) from `blobs`, its old peers' (`peers(rank,
    len(blobs), per_site)`: one per old site, in site order; flat: every old rank's)."""
    old, site = len(blobs), rank // per_site
    row = mixing_weights(old, world // per_site)[site]
    own = blobs[site] if site < old else None             # old rank `rank` itself: same site, same shard
    mine = {"scheduler": blobs[0]["scheduler"]}
    if own is not None:
        mine["rng"], mine["extra"] = own["rng"], own.get("extra", {})
    else:
        mine["rng"] = {"cpu": torch.Generator().manual_seed(rng_seed(seed, step, rank)).get_state()}
        history = blobs[0].get("extra", {}).get("inter_steps")
        mine["extra"] = {} if history is None else {"inter_steps": [(0, 0, 0)] * len(history)}
    if "optimizer" in blobs[0]:
        states = [b["optimizer"] for b in blobs]
        mine["optimizer"] = (remap(built.optimizer, states, site) if isinstance(built.optimizer, CommunicatingOptimizer)
                             else states[0])                 # a torch optimizer: the same on every rank
    if "params" in blobs[0]:
        mine["params"] = {n: mix([b["params"][n] for b in blobs], row, f"parameter {n}") for n in blobs[0]["params"]}
    return mine
