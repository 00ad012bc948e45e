"""One rank of a training run: the loop, its timing, its log.

    train_worker(rank, world, cfg, optimizer_name, lr, log_path, options)   # config.RunOptions

Each step: this rank's shard of the batch, forward, backward, `opt.step()` (which
communicates), LR schedule (linear warmup, then cosine to `min_lr_frac`). Timed per step:
the whole step (`step_s`) and the time blocked in collectives (`comm_s`); `step_s - comm_s`
is the compute a modelled link adds its transfer time to. Blocked time is measured by
timing every collective call and wait (timing.py; PowerSGD's waits too, powersgd.py).
Validation (every `eval_every` steps and at the end) runs outside the timed region; its
loss is averaged over ranks with an uncounted harness all-reduce. Rank 0 writes one JSON
line per step and per evaluation to `log_path`, and a final record with the optimizer's
own cumulative comm stats, its state's bytes on this rank, (flat layout) whether every
rank ends with bit-identical parameters, and the compute-only steps timed before and after
training (probe.py): a DDP run's own (`calibration`), any other single-tier run's dense
AdamW step on a copy of the model (`adamw_probe`). That copy also times a few AdamW steps at
every evaluation after step 0 (the eval record's `adamw_probe_s`), outside the timed steps.

Under `--sites` (cfg.sites, train/sites.py) the model is FSDP2-sharded inside each site and
the step's bytes are the inter-site ones; each step record adds FSDP2's intra-site bytes
(`intra_*`), and the final record adds `tiers`: every rank's optimizer-state bytes and, per
step, the busiest site's inter-site bytes summed over its ranks (gathered after training).
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import checkpoint_root, expected_meta, latest, save
from .config import RunOptions
from .data import load_corpus, train_batch, val_starts, windows
from .elastic import process_started, resume_from
from .faults import die_in_save, maybe_die, pace, params_digest, slow_before, step_digest
from .model import build_model
from .optimizers import get_optimizer, torch_adamw
from .probe import AdamWProbe, calibrate
from .progress import Progress
from .site_join import join, publish, site_reduce
from .site_run import gather_store, global_rank, store_record
from .sites import Tiers, optimizer_state_bytes, setup, site_sums
from .store_runs import shard_store_group, store_group
from .timing import BLOCKED, install


def lr_factor(step: int, cfg) -> float:
    """Multiplier of the base lr at 0-based `step`: linear warmup, then cosine to min_lr_frac."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model, val_ids, starts, cfg, rank: int, world: int) -> float:
    """Mean validation loss over the run's fixed windows; each rank scores its share. Every
    rank runs the same number of forward passes (under FSDP2 each one all-gathers): a rank
    whose share has run out scores a spare window and counts nothing."""
    model.eval()
    mine = starts[rank::world]
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    rows = max(1, cfg.rows)
    for i in range(0, -(-len(starts) // world), rows):
        chunk = mine[i:i + rows]
        x, y = (t.to(device) for t in windows(val_ids, chunk if len(chunk) else starts[:1], cfg.context))
        logits = model(x)
        if len(chunk):
            total[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double()
            total[1] += y.numel()
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def _device() -> torch.device:
    """CUDA under NCCL (torchrun on GPUs: init_from_env set the device), else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _record(stats, prefix: str = "") -> dict:
    s = stats.last_step
    return {prefix + "payload_bytes": s.payload_bytes, prefix + "link_bytes_sent": s.link_bytes_sent,
            prefix + "link_bytes_received": s.link_bytes_received, prefix + "collectives": s.collectives}


def _timed_step(built, sched, x, y, fsdp=None, last: bool = False, skip: bool = False) -> dict:
    """One optimizer step; its loss, lr, wall time and time blocked in (inter-site) collectives.
    The last step also flushes an exchange left in flight (overlap=True), inside its time.
    `skip`: a store site behind the run's rounds steps with zero gradients, without forward and
    backward (its message misses the round anyway: `StoreGroup.catching_up`); its loss is None."""
    BLOCKED[0] = 0.0
    t0 = time.perf_counter()
    if not built.counts_itself:
        built.stats.begin_step()              # PowerSGD and HSDP communicate inside backward
    if fsdp is not None:
        fsdp.intra.begin_step()
    if skip:
        loss = None
        for p in built.model.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
    else:
        loss = F.cross_entropy(built.model(x).flatten(0, 1), y.flatten())
        loss.backward()
    built.optimizer.step()
    if last and hasattr(built.optimizer, "flush"):
        built.optimizer.flush()
    built.optimizer.zero_grad(set_to_none=False)
    sched.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    return {"loss": None if loss is None else float(loss.detach()), **({"caught_up": True} if skip else {}), "lr": sched.get_last_lr()[0], "step_s": step_s,
            "comm_s": min(BLOCKED[0], step_s), **_record(built.stats),
            **(_record(fsdp.intra, "intra_") if fsdp is not None else {})}


JOIN_WAIT_S = 600.0                 # --join: how long a site waits for the live sites' first snapshot

# a probe's record in the final log -> the field that takes its smaller timing
PROBE_FIELDS = {"calibration": "compute_only_step_s", "adamw_probe": "adamw_step_s"}


def _adamw_probe(built, model, cfg, lr: float, batches, tiers, wanted: bool) -> AdamWProbe | None:
    """Dense AdamW's step on a copy of the model (probe.py), for a single-tier run that does not
    calibrate its own step (DDP does, under no_sync()); None across sites or when not `wanted`."""
    if wanted and built.calibrate is None and tiers is None:
        return AdamWProbe(model, lambda ps: torch_adamw(ps, cfg, lr), batches)
    return None


def _probes(built, adamw: AdamWProbe | None, batches) -> dict:
    """The compute-only steps this run calibrates (`probe.py`): a DDP run's own under no_sync(),
    or dense AdamW's on its copy of the model."""
    if built.calibrate is not None:
        return {"calibration": built.calibrate(batches)}
    return {} if adamw is None else {"adamw_probe": adamw.median_s()}


def _evaluation(model, val_ids, starts, cfg, rank: int, world: int, step: int, adamw: AdamWProbe | None) -> dict:
    """The eval record of `step`; after training has begun it also holds a few of dense AdamW's
    steps timed here (`adamw_probe_s`), so its limit follows the machine through the run."""
    rec = {"kind": "eval", "step": step, "val_loss": evaluate(model, val_ids, starts, cfg, rank, world)}
    if adamw is not None and step > 0:
        rec["adamw_probe_s"] = adamw.sample()
    return rec


def train_worker(rank: int, world: int, cfg, optimizer: str, lr: float, log_path: str | None,
                 options: RunOptions, started: float | None = None) -> None:
    """Train `cfg`'s model with `optimizer` at base `lr` on this rank; rank 0 logs to `log_path`.

    When `options.writes_checkpoints` (train/checkpoint.py): resume from the latest complete
    checkpoint under <out>/checkpoint when there is one, and write one every
    `options.checkpoint_every` steps (0: none) and at the end. A collective that fails (a peer
    died, or sent nothing for `options.peer_timeout` seconds, the process group's timeout)
    raises PeerFailure naming the step.

    A resumed run logs one "resume" record (written with its first step): the step and
    checkpoint it resumed from, the old and new world size, how per-rank state was mapped,
    the checkpoint's load time and `time_to_recover_s`, from `started` (time.time() when the
    launching command started; default: this worker process's start) to the end of that first step,
    and `first_step_at`, the time.time() of that end."""
    started = process_started() if started is None else started
    install()                                       # time what the Communicator waits on
    checkpoint_dir = str(checkpoint_root(options.out_dir)) if options.writes_checkpoints else None
    checkpoint_every = options.checkpoint_every
    train_ids, val_ids = load_corpus(options.data, cfg.vocab_size)
    device = _device()
    model = build_model(cfg).to(device)
    shard_rank, shard_world = global_rank(options, rank, world)   # under --site: across every site
    tiers, fsdp, group, shard_group = Tiers.of(cfg, shard_world), None, None, None
    if tiers is None or (tiers.flat and options.exchange):
        group = store_group(options, cfg, optimizer, lr, rank, world) if options.exchange else None
        built = get_optimizer(optimizer).build(model, cfg, lr, group=group)
    else:
        if options.exchange:
            site = sorted(options.peers).index(options.site) if options.site else tiers.site_of(rank)
            group = shard_store_group(options, cfg, optimizer, lr, site, tiers.shard_of(rank))
        model, built, fsdp, shard_group = setup(tiers, model, get_optimizer(optimizer), cfg, lr, device,
                                                across=group, one_site=bool(options.site))
    inter_steps = []                                # this rank's (payload, sent, received) per step
    sched = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda s: lr_factor(s, cfg))
    starts = val_starts(val_ids, cfg)
    meta = expected_meta(cfg, optimizer, lr, world, model)
    done = step = 0
    resume = latest(checkpoint_dir) if checkpoint_dir else None
    resumed = None                                  # the "resume" record, written with the first step
    if resume is not None:
        done, inter_steps, resumed = resume_from(resume, meta, model, built, sched, rank, world, optimizer)
        step = done
    joined = join(options, group, model, built.optimizer, sched, JOIN_WAIT_S, shard_group) if options.join else None
    if joined is not None:
        done = step = joined["step"]
        if done >= cfg.steps:
            raise RuntimeError(f"--join: the newest snapshot is at step {done}, the run's last (--steps {cfg.steps}): "
                               "nothing is left to train")
    log = _open_log(log_path, done) if rank == 0 else None
    _write(log, joined)
    bar = Progress(optimizer, cfg.steps, enabled=(rank == 0 and not options.quiet))
    try:
        if not done:
            rec = _evaluation(model, val_ids, starts, cfg, rank, world, 0, None)
            _write(log, rec)
            val = rec["val_loss"]
        batches = lambda i: tuple(t.to(device) for t in train_batch(train_ids, cfg, i, shard_rank, shard_world))  # noqa: E731
        adamw = _adamw_probe(built, model, cfg, lr, batches, tiers, options.adamw_probe)
        before = _probes(built, adamw, batches)    # compute-only steps, before and after (probe.py)
        last_step_s = None
        for step in range(done + 1, cfg.steps + 1):
            maybe_die(rank, step)
            slept = slow_before(step, last_step_s)
            x, y = (t.to(device) for t in train_batch(train_ids, cfg, step - 1, shard_rank, shard_world))
            skip = group is not None and _site_catching_up(group, shard_group)
            rec = _timed_step(built, sched, x, y, fsdp, last=(step == cfg.steps), skip=skip)
            last_step_s = rec["step_s"] - rec["comm_s"]      # its compute: a straggler's sleep must not feed on waits
            rec.update(step_digest(model), **({"slept_s": slept} if slept else {}))
            if resumed is not None:
                now = time.time()                  # first_step_at: wall clock, to time a recovery from outside
                _write(log, {**resumed, "time_to_recover_s": now - started, "first_step_at": now})
                resumed = None
            inter_steps.append((rec["payload_bytes"], rec["link_bytes_sent"], rec["link_bytes_received"]))
            _write(log, {"kind": "step", "step": step, **rec})
            if rec["loss"] is not None:
                bar.update(step, rec["loss"], built.stats.payload_bytes)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                rec = _evaluation(model, val_ids, starts, cfg, rank, world, step, adamw)
                _write(log, rec)
                val = rec["val_loss"]
                bar.note(val)
            if checkpoint_dir and ((checkpoint_every and step % checkpoint_every == 0) or step == cfg.steps):
                save(checkpoint_dir, step, model, built, sched, meta, rank, extra={"inter_steps": inter_steps},
                     before_write=die_in_save(rank, step))
            publish(options, group, model, built.optimizer, sched, step, rank, sharded=shard_group is not None)
            pace()
        after = _probes(built, adamw, batches)
        probes = {name: calibrate(before[name], after[name]) for name in before}
        if done >= cfg.steps:                      # resumed at the end: the final evaluation again
            val = evaluate(model, val_ids, starts, cfg, rank, world)
        if resumed is not None:                    # no step left to take
            _write(log, {**resumed, "time_to_recover_s": None})
        state_bytes = optimizer_state_bytes(built.optimizer)
        final = {"kind": "final", "comm_stats": built.stats.state_dict(), "val_loss": val,
                 "n_params": sum(p.numel() for p in model.parameters()), "optimizer_state_bytes": state_bytes}
        for name, record in probes.items():       # DDP's own compute-only step, or dense AdamW's here
            final[name], final[PROBE_FIELDS[name]] = record, record["step_s"]
        if tiers is not None:
            final["tiers"] = _gather_tiers(tiers, world, state_bytes, inter_steps)
            final["params_sha256"] = params_digest(model)       # the whole model's: every rank of a site agrees
        else:
            final["replicas_identical"], final["params_sha256"] = _replicas_identical(model, world)
        if group is not None:
            final["store"] = gather_store(store_record(group), world)
        _write(log, final)
    except Exception as err:
        if peer_failed(err):
            raise PeerFailure(f"rank {rank} of {world}: step {step}: a peer died or did not answer within the "
                              f"peer timeout ({_seconds(options.peer_timeout)}); no checkpoint of it was written "
                              f"({type(err).__name__}: {_first_line(err)})") from err
        raise
    finally:
        bar.close()
        if log:
            log.close()


def _site_catching_up(group, shard_group) -> bool:
    """`StoreGroup.catching_up` for this rank, agreed by every rank of its site when FSDP2
    shards it (`shard_group`): each shard has its own rounds, and one shard that skips its
    forward and backward while another runs them would leave FSDP2's collectives unmatched."""
    behind = group.catching_up()
    if shard_group is None:
        return behind
    return bool(site_reduce([int(behind)], dist.ReduceOp.MAX, shard_group)[0])


def _replicas_identical(model, world: int) -> tuple[bool, str]:
    """Whether every rank (of this command) ends with bit-identical parameters (flat layout; an
    uncounted harness all-gather of a digest), and this rank's SHA-256 of them, parameter by
    parameter in order, so runs (a --site run's sites) compare without a connection.
    LoRDO and DiLoCo: identical only when the last step was a sync."""
    mine = params_digest(model)
    everyone = [mine] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    return len(set(everyone)) == 1, mine


def _gather_tiers(tiers: Tiers, world: int, state_bytes: int, inter_steps: list) -> dict:
    """Every rank's optimizer-state bytes and per-step inter-site bytes, gathered (uncounted)."""
    everyone = [None] * world
    dist.all_gather_object(everyone, (state_bytes, inter_steps))
    return {"sites": tiers.sites, "ranks_per_site": tiers.ranks_per_site,
            "optimizer_state_bytes": [b for b, _ in everyone],
            "site": site_sums([steps for _, steps in everyone], tiers)}


def _write(log, record: dict | None) -> None:
    if log is not None and record is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()


class PeerFailure(RuntimeError):
    """A collective failed on this rank: a peer died or did not answer within the timeout."""


def peer_failed(err: BaseException) -> bool:
    """Whether `err` is a collective's failure (gloo/NCCL: peer gone, connection lost, timeout),
    not thinwire's own errors raised on every rank (mismatched peers, non-finite gradients)."""
    from ..optim.protocol import NonFiniteGradientError, PeerMismatchError
    if isinstance(err, (PeerMismatchError, NonFiniteGradientError)):
        return False
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _seconds(t: float | None) -> str:
    return "the process group's default" if t is None else f"{t:g} s"


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


def _open_log(log_path: str | None, done: int):
    """Rank 0's log; when resuming at step `done`, the records of steps after it (written by
    the interrupted run before it died) and its final record are dropped first."""
    if not log_path:
        return None
    if done and os.path.exists(log_path):
        with open(log_path) as f:
            keep = [line for line in f if line.strip() and _kept(json.loads(line), done)]
        log = open(log_path, "w")
        log.writelines(keep)
        return log
    return open(log_path, "w")


def _kept(record: dict, done: int) -> bool:
    return record.get("kind") != "final" and record.get("step", 0) <= done
