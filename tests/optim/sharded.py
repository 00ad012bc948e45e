"""The contract for two tiers, run inside real gloo workers: every registry configuration on
FSDP2-sharded parameters, 2 sites x 2 ranks (`run_two_tier`), and at one rank per site
against the flat path (`run_one_per_site`).

Rank r is in site r // 2 and holds shard r % 2 (consecutive ranks share a site, as torchrun
--nnodes lays them out). The model is problem.py's regression widened to 24 -> 64 -> 20
(fitting the teacher's 10 outputs twice over), whose shards (32, 24), (32,), (10, 64), (10,)
have DeMo chunk geometries in the registry and need no padding, nor do the whole tensors,
so a shard's state is exactly its share of the whole's.
"""

from __future__ import annotations

import io
import traceback

import torch
import torch.distributed as dist

from tests.dist import outcome_of
from tests.optim import problem
from tests.optim.registry import REGISTRY
from tests.optim.suite import RESUME_AT, STEPS

SITES = 2


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(problem.IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2 * problem.OUT))


def loss_on(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), torch.cat([y, y], dim=1))


def eval_loss(model) -> float:
    """Every rank must call it (an FSDP2 forward all-gathers over the site). FSDP2 leaves the
    root's parameters unsharded after a forward without backward: reshard them."""
    gen = torch.Generator().manual_seed(999_999)
    x = torch.randn(512, problem.IN, generator=gen)
    with torch.no_grad():
        loss = float(loss_on(model, x, problem._teacher()(x)))
    if hasattr(model, "reshard"):
        model.reshard()
    return loss


def sharded(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh["shard"])
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def flat_local(model) -> torch.Tensor:
    return torch.cat([local(p.detach()).reshape(-1) for p in model.parameters()])


def flat_full(model) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def state_nbytes(opt) -> int:
    """Bytes of every tensor of optimizer state on this rank (DTensors: their local part),
    wrapped optimizers (DenseAllReduce, DiLoCo's inner) included."""
    inner = [*getattr(opt, "optimizers", []), *([opt.inner] if hasattr(opt, "inner") else [])]
    return sum(local(v).nbytes for o in [opt, *inner] for s in o.state.values() for v in s.values()
               if torch.is_tensor(v))


def train(opt, model, rank: int, start: int, stop: int) -> list:
    log = []
    for step in range(start, stop):
        x, y = problem.batch(rank, step)
        loss_on(model, x, y).backward()
        status, _ = outcome_of(opt.step)
        opt.zero_grad()
        log.append((status, {tag: c.as_dict() for tag, c in opt.comm_stats.by_tag.items()}))
    if stop == STEPS:
        opt.flush()                    # overlap: the last exchange lands (LoRDO/DiLoCo: the last sync)
    return log


def _round_trip(obj):
    blob = io.BytesIO()
    torch.save(obj, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=False)


def case_two_tier(name: str, rank: int, mesh) -> dict:
    """Uninterrupted run, and one checkpointed at RESUME_AT (this rank's shards and optimizer
    state) and resumed into a fresh model and optimizer."""
    build, group = REGISTRY[name].build, mesh["site"].get_group()
    model = sharded(make_model(), mesh)
    opt = build(list(model.parameters()), process_group=group)
    before = eval_loss(model)
    log = train(opt, model, rank, 0, RESUME_AT)
    # checkpointed by the run itself (copies, through torch.save) rather than by a second run to
    # RESUME_AT: the same steps at half a run's cost, and state_dict() only observes (test_suite.py)
    saved = _round_trip({"params": [local(p.detach()).clone() for p in model.parameters()], "opt": opt.state_dict()})
    log += train(opt, model, rank, RESUME_AT, STEPS)
    fresh = sharded(make_model(seed=77), mesh)
    with torch.no_grad():
        for p, value in zip(fresh.parameters(), saved["params"]):
            local(p).copy_(value)
    fresh_opt = build(list(fresh.parameters()), process_group=group)
    fresh_opt.load_state_dict(saved["opt"])
    train(fresh_opt, fresh, rank, RESUME_AT, STEPS)
    return {"local": flat_local(model), "full": flat_full(model), "resumed": flat_local(fresh), "log": log,
            "loss_before": before, "loss_after": eval_loss(model), "site_rank": dist.get_rank(group),
            "shapes": [tuple(local(p).shape) for p in model.parameters()], "state_nbytes": state_nbytes(opt)}


def _cases(names, fn) -> dict:
    results = {}
    for name in names:
        try:
            results[name] = fn(name)
        except Exception:  # one failing configuration must not hide the others' results
            results[name] = {"error": traceback.format_exc()}
    return results


def run_two_tier(rank: int, world: int, names) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (SITES, world // SITES), mesh_dim_names=("site", "shard"))
    return _cases(names, lambda name: case_two_tier(name, rank, mesh))


def case_one_per_site(name: str, rank: int, mesh) -> dict:
    """The same steps on plain parameters (the flat path) and on FSDP2 parameters over a
    one-rank shard mesh; and the flat run's optimizer-state bytes."""
    build = REGISTRY[name].build
    flat_model = make_model()
    flat_opt = build(list(flat_model.parameters()))
    train(flat_opt, flat_model, rank, 0, STEPS)
    model = sharded(make_model(), mesh)
    opt = build(list(model.parameters()), process_group=mesh["site"].get_group())
    train(opt, model, rank, 0, STEPS)
    return {"flat": flat_local(flat_model), "sharded": flat_local(model), "state_nbytes": state_nbytes(flat_opt)}


def run_one_per_site(rank: int, world: int, names) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("site", "shard"))
    return _cases(names, lambda name: case_one_per_site(name, rank, mesh))


def case_one_site(name: str, rank: int, mesh, alone) -> dict:
    """One site of two shards against an independent reference: the flat optimizer on a plain
    model in a process of its own (a one-rank group), fed the site's mean gradient directly
    (the loss averaged over both ranks' batches). The sharded run must match it to float
    tolerance: whole-matrix operations must see the whole matrix."""
    build = REGISTRY[name].build
    model = sharded(make_model(), mesh)
    opt = build(list(model.parameters()), process_group=mesh["site"].get_group())
    train(opt, model, rank, 0, STEPS)
    reference = make_model()
    ref_opt = build(list(reference.parameters()), process_group=alone)
    for step in range(STEPS):
        losses = [loss_on(reference, *problem.batch(r, step)) for r in range(mesh["shard"].size())]
        (sum(losses) / len(losses)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_opt.flush()                                        # as train() does for the sharded run
    return {"sharded": flat_full(model), "reference": flat_local(reference)}


def run_one_site(rank: int, world: int, names) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("site", "shard"))
    alone, _ = dist.new_subgroups(group_size=1)
    return _cases(names, lambda name: case_one_site(name, rank, mesh, alone))
