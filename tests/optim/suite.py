"""The contract every optimizer configuration in `registry.CONFIGS` passes, run inside real
gloo workers.

`run_suite(rank, world, names)` runs the cases below that each named configuration lists
(every one for REGISTRY's; 'run' for VARIANTS') and returns {(name, case): result or
{'error': traceback}}; test_suite.py asserts on them. `on_world(fn, world)` runs such a
function on every rank of a world.
"""

from __future__ import annotations

import io
import traceback
from contextlib import nullcontext

import torch

from tests.dist import outcome_of, run_workers
from tests.optim import problem
from tests.optim.registry import CONFIGS
from thinwire.integrations import CollectiveCounter

STEPS, RESUME_AT, BAD_STEP = 12, 6, 5     # three syncs at K = 4, a resume and a bad gradient mid-interval


def on_world(fn, world: int, *args, timeout: float = 900) -> list:
    """[fn(rank, world, *args) per rank]: gloo workers, or for a world of one this process
    (no process group, no spawn) on one thread, as a worker."""
    if world > 1:
        return run_workers(fn, world, args=args, timeout=timeout)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [fn(0, 1, *args)]
    finally:
        torch.set_num_threads(threads)


def train(opt, model, rank: int, start: int, stop: int, bad_step: int | None = None, scheduler=None,
          end: int = STEPS) -> list:
    """Steps start..stop-1 on this rank's batches; at bad_step the last rank's gradient is NaN;
    the run ends (flush) at step `end`. Returns, per step, ('ok' | error type name, the
    cumulative counters by tag, the step's own counters)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    log = []
    for step in range(start, stop):
        x, y = problem.batch(rank, step)
        dtype = next(model.parameters()).dtype
        problem.loss_on(model, x.to(dtype), y.to(dtype)).backward()
        if step == bad_step and rank == world - 1:
            next(p for p in model.parameters() if p.grad is not None).grad[0].fill_(float("nan"))
        status, _ = outcome_of(opt.step)
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        stats = opt.comm_stats
        log.append((status, {tag: c.as_dict() for tag, c in stats.by_tag.items()}, stats.last_step.as_dict()))
    if stop == end:
        opt.flush()                    # overlap: the last exchange lands (LoRDO/DiLoCo: the last sync)
    return log


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def exact(model, opt) -> torch.Tensor:
    """The parameters as the optimizer holds them: under DeMo's lookahead the caller's are
    moved by an estimate until flush(), and the exact ones are in the optimizer's copy."""
    if getattr(opt, "_looked_ahead", None) is not None:
        return torch.cat([t.detach().float().reshape(-1) for t in opt._saved])
    return flat(model)


def _checkpoint(model, opt) -> dict:
    blob = io.BytesIO()
    opt_state = opt.state_dict()              # it records an exchange still in flight
    torch.save({"model": model.state_dict(), "opt": opt_state}, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=False)


def case_run(name, rank, dtype=torch.float32, count: bool = True, undisturbed: bool = True):
    """A run that takes a checkpoint (state_dict) half way (RESUME_AT of STEPS, or of the
    configuration's own `steps`) and goes on, one resumed from that checkpoint into fresh
    objects, and, for a configuration with an exchange in flight between steps (delay 1), the
    same run with no state_dict at all (`undisturbed`: state_dict() must only observe; False:
    not run, for a caller whose test does not read it). `count`: whether the resumed run's
    collectives are counted (`resumed_handed`)."""
    build, steps = CONFIGS[name].build, CONFIGS[name].steps or STEPS
    resume_at = steps // 2
    model = problem.make_model().to(dtype)
    opt = build(list(model.parameters()))
    before = problem.eval_loss(model.float()) if dtype == torch.float32 else None
    log = train(opt, model, rank, 0, resume_at, end=steps)
    # the checkpoint comes from this run itself (a copy, through torch.save), not from a
    # second run to resume_at: the same steps, bit for bit, at half a run's cost
    saved = _checkpoint(model, opt)
    dtypes = _state_dtypes(saved["opt"])
    log += train(opt, model, rank, resume_at, steps, end=steps)
    if undisturbed and CONFIGS[name].delay:
        plain = problem.make_model().to(dtype)
        train(build(list(plain.parameters())), plain, rank, 0, steps, end=steps)
        undisturbed = flat(plain)
    else:
        undisturbed = None
    fresh = problem.make_model(seed=77).to(dtype)             # a different init: the checkpoint restores it
    fresh.load_state_dict(saved["model"])
    fresh_opt = build(list(fresh.parameters()))
    fresh_opt.load_state_dict(saved["opt"])
    loaded = _state_dtypes(fresh_opt.state_dict())
    # every byte the resumed run hands to torch.distributed. The counter is a dispatch mode that
    # sends every tensor op through Python (the run case's cost nearly doubles), so it is entered
    # only where test_suite.py reads it: fp32, on a process group (a world of one hands nothing over)
    counting = count and torch.distributed.is_initialized()
    at_load, handed = fresh_opt.comm_stats.payload_bytes, CollectiveCounter() if counting else None
    with handed if counting else nullcontext():
        train(fresh_opt, fresh, rank, resume_at, steps, end=steps)
    return {"params": flat(model), "resumed": flat(fresh), "undisturbed": undisturbed, "log": log,
            "loss_before": before, "loss_after": problem.eval_loss(model.float()) if before else None,
            "state_dtypes": (dtypes, loaded), "shapes": [tuple(p.shape) for p in model.parameters()],
            "by_tag": _by_tag(opt), "resumed_by_tag": _by_tag(fresh_opt),
            "resumed_counted": fresh_opt.comm_stats.payload_bytes - at_load,
            "resumed_handed": handed.bytes() if counting else None}


def _state_dtypes(state_dict: dict) -> dict:
    return {k: v.dtype for s in state_dict.get("state", {}).values() for k, v in s.items() if torch.is_tensor(v)}


def _by_tag(opt) -> dict:
    return {tag: c.as_dict() for tag, c in opt.comm_stats.by_tag.items()}


def case_bf16(name, rank):
    """case_run in bf16; its test reads no counters and no undisturbed run (test_suite.py's
    state_dict check is the fp32 run's), so neither is paid for (a whole extra run of every
    configuration with an exchange in flight)."""
    return case_run(name, rank, torch.bfloat16, count=False, undisturbed=False)


def case_lambda_warmup(name, rank):
    """LambdaLR from 0: the first step moves nothing; training still converges."""
    model = problem.make_model()
    opt = CONFIGS[name].build(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))
    start = flat(model)
    train(opt, model, rank, 0, 1, scheduler=sched)
    unmoved = torch.equal(flat(model), start)
    train(opt, model, rank, 1, STEPS, scheduler=sched)
    return {"unmoved": unmoved, "params": flat(model), "loss_before": problem.eval_loss(problem.make_model()),
            "loss_after": problem.eval_loss(model)}


def case_one_cycle(name, rank):
    model = problem.make_model()
    opt = CONFIGS[name].build(list(model.parameters()))
    max_lr = [g["lr"] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=STEPS, cycle_momentum=False)
    log = train(opt, model, rank, 0, STEPS, scheduler=sched)
    return {"statuses": [s for s, *_ in log], "params": flat(model),
            "loss_before": problem.eval_loss(problem.make_model()), "loss_after": problem.eval_loss(model)}


def case_add_param_group(name, rank):
    model = problem.make_model()
    first, second = model[0], model[2]
    opt = CONFIGS[name].build([{"params": list(first.parameters())}])
    opt.add_param_group({"params": list(second.parameters())})
    start = [p.detach().clone() for p in model.parameters()]
    train(opt, model, rank, 0, STEPS)
    return {"moved": [not torch.equal(p, s) for p, s in zip(model.parameters(), start)], "params": flat(model)}


def case_closure(name, rank):
    model = problem.make_model()
    opt = CONFIGS[name].build(list(model.parameters()))
    x, y = problem.batch(rank, 0)

    def closure():
        opt.zero_grad()
        loss = problem.loss_on(model, x, y)
        loss.backward()
        return loss
    with torch.no_grad():
        expected = float(problem.loss_on(model, x, y))
    start = flat(model)
    got = [float(opt.step(closure).detach()) for _ in range(CONFIGS[name].every + CONFIGS[name].delay)]
    return {"loss": got[0], "expected": expected, "moved": not torch.equal(flat(model), start)}


def case_nonfinite(name, rank, policy):
    model = problem.make_model()
    build = CONFIGS[name].build
    opt = build(list(model.parameters()))
    opt.nonfinite = policy if hasattr(opt, "nonfinite") else None
    snapshots = []
    statuses = []
    for step in range(STEPS):
        before = exact(model, opt)
        log = train(opt, model, rank, step, step + 1, bad_step=BAD_STEP)
        statuses.append(log[0][0])
        snapshots.append(torch.equal(exact(model, opt), before))
    return {"statuses": statuses, "unmoved": snapshots, "params": flat(model)}


def case_frozen_and_unused(name, rank):
    """A frozen parameter and a parameter that never gets a gradient (on any rank) stay put,
    an empty parameter is skipped, and the others train."""
    model = problem.make_model()
    model[0].bias.requires_grad_(False)
    unused = torch.nn.Parameter(torch.randn(6, 5))
    empty = torch.nn.Parameter(torch.empty(0, 5))
    opt = CONFIGS[name].build([*model.parameters(), unused, empty])
    frozen, idle = model[0].bias.detach().clone(), unused.detach().clone()
    start = model[0].weight.detach().clone()
    train(opt, model, rank, 0, STEPS)
    return {"frozen": torch.equal(model[0].bias, frozen), "unused": torch.equal(unused, idle),
            "trained": not torch.equal(model[0].weight, start), "params": flat(model)}


class _ConvNet(torch.nn.Module):
    """A channels_last conv weight and a transposed (non-contiguous) matrix parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.head = torch.nn.Parameter(torch.randn(10, 16).t() * 0.1)      # [16, 10], strides (1, 16)

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3)) @ self.head[:4]


def case_non_contiguous(name, rank):
    net = _ConvNet()
    assert not net.head.is_contiguous() and not net.conv.weight.is_contiguous()
    opt = CONFIGS[name].build(list(net.parameters()))
    start = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(4, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    end = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"params": end, "moved": not torch.equal(end, start), "finite": bool(torch.isfinite(end).all())}


def case_bad_peers(name, rank):
    """Shapes that differ across ranks, then a rank resumed at another step: PeerMismatchError everywhere."""
    params = [torch.nn.Parameter(torch.randn(16, 16 if rank == 0 else 17)), torch.nn.Parameter(torch.zeros(4))]
    opt = CONFIGS[name].build(params)
    for p in params:
        p.grad = torch.randn_like(p)
    shapes = outcome_of(lambda: [opt.step() for _ in range(CONFIGS[name].every)])
    model = problem.make_model()
    opt = CONFIGS[name].build(list(model.parameters()))
    train(opt, model, rank, 0, 1)
    state = opt.state_dict()
    if rank == 1:
        state = {**state, "thinwire_step": state["thinwire_step"] + 3}      # as if from another checkpoint
    opt.load_state_dict(state)
    log = train(opt, model, rank, 1, 1 + CONFIGS[name].every)
    return {"shapes": shapes[0], "lockstep": [s for s, *_ in log]}


CASES = {"run": case_run, "bf16": case_bf16, "lambda_warmup": case_lambda_warmup, "one_cycle": case_one_cycle,
         "add_param_group": case_add_param_group, "closure": case_closure,
         "nonfinite_raise": lambda n, r: case_nonfinite(n, r, "raise"),
         "nonfinite_skip": lambda n, r: case_nonfinite(n, r, "skip"),
         "frozen_and_unused": case_frozen_and_unused, "non_contiguous": case_non_contiguous,
         "bad_peers": case_bad_peers}


def run_suite(rank: int, world: int, names) -> dict:
    results = {}
    for name in names:
        for case in CONFIGS[name].cases or CASES:
            fn = CASES[case]
            if case == "bad_peers" and world == 1:
                continue
            try:
                results[(name, case)] = fn(name, rank)
            except Exception:  # one failing case must not hide the others' results
                results[(name, case)] = {"error": traceback.format_exc()}
    return results
