"""Two tiers in the harness (`--sites S`): S sites of W/S ranks each, FSDP2 inside a site,
the optimizer across sites (docs/design.md, "Two tiers").

    tiers = Tiers.of(cfg, world)                  # None without --sites
    model, built, fsdp, shard_group = setup(tiers, model, spec, cfg, lr, device)

Rank r is in site r // (W/S): consecutive ranks share a site, as `torchrun --nnodes S`
numbers them (node-major), so one node is one site. Inside every worker:

  * one rank per site (S == W) is the flat case: no sharding, the optimizer on the world
    group, exactly what runs without `--sites`;
  * a thinwire optimizer: `fully_shard(block, mesh=mesh["shard"])` per transformer block,
    then on the root (which keeps the tied embedding/head pair in one FSDP unit), and the
    optimizer on the DTensor shards with `process_group=mesh["site"].get_group()`;
  * a dense baseline (AdamW, Adam) is what a user would run: FSDP2 HSDP on the 2-D mesh
    (parameters Replicate over "site", Shard over "shard"; the gradient reduce-scattered in
    the site and all-reduced across sites) with the plain torch optimizer. Dense Muon is
    DenseAllReduce around torch's Muon on the 1-D shards (HSDP's traffic, all-reduced by
    thinwire's communicator): under HSDP's 2-D placements its Newton–Schulz would make
    DTensor all-reduce across sites itself, uncounted; on 1-D shards DTensor's gathers stay
    inside the site.

Bytes, by tier, all measured (`count_fsdp_collectives`): FSDP2 issues its collectives
through the `dist` name of `torch.distributed.fsdp._fully_shard._fsdp_collectives`; that
name points at a proxy that records each tensor it hands over (real `nbytes`, the link
formulas of thinwire.comm.links) and forwards the call, as train/powersgd.py does for the
DDP hook. A collective on the site group (HSDP's all-reduce) is inter-site traffic,
counted in the stats the loop logs as the run's payload and timed into timing.BLOCKED;
the all-gathers and reduce-scatters on the shard group are intra-site traffic (FSDPStats.intra),
not timed apart (the fast tier counts as compute). A thinwire optimizer counts its own
inter-site bytes in `opt.comm_stats`; gathers it makes over the site itself (whole-matrix
operations) are not in either figure.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import CommStats, link_bytes
from .config import check_sites
from .timing import BLOCKED


@dataclass(frozen=True)
class Tiers:
    sites: int
    ranks_per_site: int

    @classmethod
    def of(cls, cfg, world: int) -> "Tiers | None":
        """The tiers of `cfg.sites` over `world` ranks; None without --sites (cfg.sites == 0)."""
        if not cfg.sites:
            return None
        check_sites(cfg.sites, world)
        return cls(cfg.sites, world // cfg.sites)

    @property
    def flat(self) -> bool:
        """One rank per site: nothing to shard, the same code as without --sites."""
        return self.ranks_per_site == 1

    def site_of(self, rank: int) -> int:
        return rank // self.ranks_per_site

    def shard_of(self, rank: int) -> int:
        """Which shard of the model `rank` holds: its place in its site."""
        return rank % self.ranks_per_site

    def mesh(self, device_type: str, one_site: bool = False):
        """The [sites, shard] mesh over this command's world; with `one_site` (a --site run,
        whose world is one site) the 1-D [shard] mesh."""
        from torch.distributed.device_mesh import init_device_mesh
        if one_site:
            return init_device_mesh(device_type, (self.ranks_per_site,), mesh_dim_names=("shard",))
        return init_device_mesh(device_type, (self.sites, self.ranks_per_site), mesh_dim_names=("site", "shard"))


def why_not_on_shards(spec) -> str | None:
    """Why optimizer `spec` cannot run with several ranks per site, or None when it can."""
    if spec.hsdp is not None or spec.on_shards:
        return None
    return spec.why_no_shards or f"{spec.name} cannot run on FSDP2 shards"


def narrow_parameter(model: torch.nn.Module, ranks_per_site: int) -> str | None:
    """Why `model` cannot be FSDP2-sharded over `ranks_per_site` ranks for a thinwire optimizer,
    or None: a parameter with fewer rows than ranks (a GQA k/v projection of 1 head x 2 dims at
    3 ranks per site) leaves some rank none of it, which the optimizers refuse
    (optim/shards.check_sharding); checked on a meta-device model before any worker starts."""
    for name, p in model.named_parameters():
        if p.dim() and p.shape[0] < ranks_per_site:
            return (f"{name} {list(p.shape)} has fewer rows than the {ranks_per_site} ranks of a site, so FSDP2 "
                    f"would leave some rank none of it")
    return None


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 on `mesh` (1-D: shard in the site; 2-D: HSDP), torchtitan style: each transformer
    block its own unit, then the root, which holds the tied embedding/head and the rest.
    Parameters stay gathered from forward to backward (`reshard_after_forward=False`: one
    all-gather and one reduce-scatter per unit and step inside the site, ZeRO-2's traffic;
    re-gathering in backward cost a quarter of the step on 2 CPU cores, and memory is no
    constraint at these sizes). Dense baselines and thinwire optimizers share the setting."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


@dataclass
class FSDPStats:
    """What FSDP2 handed to torch.distributed in this process: `inter` (on the site group:
    HSDP's all-reduce) and `intra` (on the shard group: all-gathers, reduce-scatters)."""
    inter: CommStats
    intra: CommStats


class _CountingDist:
    """Forwards every attribute to torch.distributed; FSDP2's three collectives are recorded
    first, by the group they run on, and the site group's are timed into BLOCKED."""

    def __init__(self, stats: FSDPStats, site_group):
        self._stats, self._lock = stats, threading.Lock()
        # no site group (the store carries the tier across sites): every FSDP2 collective is intra-site
        self._site_ranks = None if site_group is None else dist.get_process_group_ranks(site_group)

    def __getattr__(self, name):
        return getattr(dist, name)

    def _record(self, op: str, tag: str, nbytes: int, group) -> bool:
        inter = dist.get_process_group_ranks(group or dist.group.WORLD) == self._site_ranks
        sent, received = link_bytes(op, nbytes, dist.get_world_size(group))
        with self._lock:
            (self._stats.inter if inter else self._stats.intra).record(tag, nbytes, sent, received)
        return inter

    def _timed(self, inter: bool, fn, *args, **kwargs):
        t = time.perf_counter()
        work = fn(*args, **kwargs)
        if inter:
            if work is not None:
                work.wait()
            BLOCKED[0] += time.perf_counter() - t
        return work

    def all_reduce(self, tensor, *args, group=None, **kwargs):
        inter = self._record("all_reduce", "hsdp_all_reduce", tensor.nbytes, group)
        return self._timed(inter, dist.all_reduce, tensor, *args, group=group, **kwargs)

    def all_gather_single(self, output_tensor, input_tensor, *args, group=None, **kwargs):
        inter = self._record("all_gather", "fsdp_all_gather", input_tensor.nbytes, group)
        return self._timed(inter, dist.all_gather_single, output_tensor, input_tensor, *args, group=group, **kwargs)

    def reduce_scatter_single(self, output, input, *args, group=None, **kwargs):
        # ring reduce-scatter of an n-byte input: n(W-1)/W each way, all_to_all's row in comm/links.py
        inter = self._record("all_to_all", "fsdp_reduce_scatter", input.nbytes, group)
        return self._timed(inter, dist.reduce_scatter_single, output, input, *args, group=group, **kwargs)


def count_fsdp_collectives(site_group) -> FSDPStats:
    """Point FSDP2's `dist` at a counting proxy (once per worker process); the stats it fills."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    if not hasattr(_fsdp_collectives, "dist"):
        raise RuntimeError("this torch's FSDP2 no longer issues collectives through _fsdp_collectives.dist; "
                           "the harness cannot count its bytes")
    stats = FSDPStats(CommStats(), CommStats())
    _fsdp_collectives.dist = _CountingDist(stats, site_group)
    return stats


def setup(tiers: Tiers, model: torch.nn.Module, spec, cfg, lr: float, device: torch.device, across=None,
          one_site: bool = False):
    """(model, Built, FSDPStats or None, the site's shard group or None) for this rank under
    `tiers` (see the module docstring). `across`: the optimizer's group across sites when it is
    not the mesh's site group (a `thinwire.store.StoreGroup` of this rank's shard, --exchange);
    `one_site`: this command's world is one site (--site), so there is no site group at all."""
    from .optimizers import Built
    if tiers.flat:
        return model, spec.build(model, cfg, lr, group=across), None, None
    reason = why_not_on_shards(spec)
    if reason:
        raise ValueError(reason)
    mesh = tiers.mesh(device.type, one_site)
    site_group = None if one_site else mesh["site"].get_group()
    shard_mesh = mesh if one_site else mesh["shard"]
    fsdp = count_fsdp_collectives(None if across is not None else site_group)
    if spec.hsdp is not None:                 # the dense baseline: HSDP, FSDP2 all-reduces across sites
        shard_model(model, mesh)
        built = Built(spec.hsdp(model.parameters(), cfg, lr), model, fsdp.inter, counts_itself=False)
        return model, built, fsdp, shard_mesh.get_group()
    shard_model(model, shard_mesh)
    group = across if across is not None else site_group
    return model, spec.build(model, cfg, lr, group=group), fsdp, shard_mesh.get_group()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `opt.state` on this rank (a DTensor counts its local shard),
    with the state of every optimizer it wraps (DenseAllReduce's, DiLoCo's inner: any
    attribute that is an optimizer or a list of them); a storage shared twice counts once."""
    walked, counted, total = set(), set(), 0

    def walk(o: torch.optim.Optimizer) -> None:
        nonlocal total
        if id(o) in walked:
            return
        walked.add(id(o))
        for t in _tensors(list(o.state.values())):
            local = t.to_local() if hasattr(t, "to_local") else t
            key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.nbytes)
            if local.nbytes and key not in counted:
                counted.add(key)
                total += local.nbytes
        for attr in vars(o).values():
            inner = attr if isinstance(attr, (list, tuple)) else [attr]
            for x in inner:
                if isinstance(x, torch.optim.Optimizer):
                    walk(x)

    walk(opt)
    return total


def site_sums(per_rank: list[list[tuple[int, int, int]]], tiers: Tiers) -> dict[str, list[int]]:
    """Per step, the busiest site's sums over its ranks of (payload, link sent, link received)
    bytes: what its one link to the other sites carries. `per_rank[r][step]` is rank r's."""
    steps = len(per_rank[0])
    out = {"payload_bytes": [], "link_bytes_sent": [], "link_bytes_received": []}
    for i in range(steps):
        sums = [[0, 0, 0] for _ in range(tiers.sites)]
        for rank, rows in enumerate(per_rank):
            site = sums[tiers.site_of(rank)]
            for k in range(3):
                site[k] += rows[i][k]
        for k, key in enumerate(out):
            out[key].append(max(s[k] for s in sums))
    return out
