"""Sites that join a store run already going: `--snapshot-every ROUNDS` on the live sites,
`--join` on the newcomer.

    THINWIRE_EXCHANGE_KEY=<hex> thinwire train ... --exchange URL --site a --peers a,b,c --snapshot-every 10
    THINWIRE_EXCHANGE_KEY=<hex> thinwire train ... --exchange URL --site b --peers a,b,c --snapshot-every 10
    THINWIRE_EXCHANGE_KEY=<hex> thinwire train ... --exchange URL --site c --peers a,b,c --join    # later

Every `snapshot_every` rounds the first worker of each live site writes a snapshot
(`store.snapshots.publish_snapshot`: the model, the optimizer's replicated state, and here the
harness's step and learning-rate schedule; the first write of a round wins, the replicas being
identical). A joining site loads the newest snapshot that verifies, starts its collectives at
the round after it, and trains from the snapshot's step: the rounds that closed since return at
once from their manifests while it steps with zero gradients (`StoreGroup.catching_up`), so it
reaches the live sites' round and is taken again from the first round it publishes in time.
Its per-rank optimizer state starts from zero, as an elastic run's new rank does.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .config import RunOptions

SNAPSHOT_WAIT_S = 0.5               # between looks for a first snapshot, while the live sites make one


def check_join(opts: RunOptions, optimizers: list[str]) -> None:
    """ValueError, before any worker starts, when --snapshot-every / --join cannot run."""
    every = opts.snapshot_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"--snapshot-every must be an int >= 0 (rounds between snapshots), got {every!r}")
    if not opts.join_timeout > 0:
        raise ValueError(f"--join-timeout must be > 0 seconds, got {opts.join_timeout}")
    if every and not opts.exchange:
        raise ValueError("--snapshot-every writes snapshots to the store: give --exchange URL")
    if opts.join and not opts.site:
        raise ValueError("--join makes this site join a store run already going: give --exchange URL and --site")
    if every or opts.join:
        overlapped = [name for name in optimizers if name.endswith("-overlap")]
        if overlapped:
            raise ValueError(f"--snapshot-every/--join: {', '.join(overlapped)} keeps a step's exchange in flight "
                             "between steps, and a snapshot is taken between steps with none in flight")


def publish(opts: RunOptions, group, model, optimizer, sched, step: int, rank: int, sharded: bool = False) -> None:
    """The snapshot after `step` when its round is due: one worker per site writes, or with
    `sharded` (FSDP2 inside the site) every worker, its shard's, in its shard's rounds."""
    if group is None or not opts.snapshot_every or (rank != 0 and not sharded):
        return
    from ..store.snapshots import publish_snapshot
    publish_snapshot(group, model, optimizer, opts.snapshot_every,
                     extra={"step": step, "scheduler": sched.state_dict()})


def join(opts: RunOptions, group, model, optimizer, sched, timeout_s: float, shard_group=None) -> dict:
    """Load the store's newest snapshot into this worker and move its rounds after it; the
    "join" record (round, step). Waits up to `timeout_s` for a first snapshot to appear. With
    `shard_group` (FSDP2 inside the site) each worker loads its shard's snapshot, of the newest
    round every shard of the site has (an all-reduce MIN inside the site)."""
    from ..store.snapshots import latest_snapshot, load_local
    rounds, deadline = group.rounds, time.monotonic() + timeout_s
    while (found := latest_snapshot(rounds.location, rounds.key, rounds.fingerprint)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"--join: no snapshot of this run in {opts.exchange} after {timeout_s:g} s; the "
                               "live sites write them with --snapshot-every ROUNDS")
        time.sleep(SNAPSHOT_WAIT_S)
    if shard_group is not None:
        agreed, = site_reduce([found[0]], dist.ReduceOp.MIN, shard_group)
        if agreed != found[0]:
            found = latest_snapshot(rounds.location, rounds.key, rounds.fingerprint, at_most=agreed)
        mine = -1 if found is None else found[0]
        least, minus_most = site_reduce([mine, -mine], dist.ReduceOp.MIN, shard_group)
        if least != -minus_most:                                                # every rank decides alike
            raise RuntimeError(f"--join: the shards of this site found no snapshot of one round (round {agreed} "
                               "is missing or does not verify for some shard)")
        if found is None:
            raise RuntimeError(f"--join: no shard of this site has a snapshot of round {agreed} or before that verifies")
    round, state = found
    load_local(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["extra"]["scheduler"])
    group.next_round = round + 1
    return {"kind": "join", "round": round, "step": int(state["extra"]["step"])}


def site_reduce(values: list[int], op, shard_group) -> list[int]:
    """`values` reduced elementwise by `op` (a `dist.ReduceOp`) over the ranks of this site: one
    all-reduce inside it, for what FSDP2's ranks of a site must decide alike."""
    reduced = torch.tensor(values)
    dist.all_reduce(reduced, op=op, group=shard_group)
    return reduced.tolist()
