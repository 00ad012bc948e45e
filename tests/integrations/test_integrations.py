"""The framework-agnostic pieces (thinwire.integrations) on 2 real gloo processes, one spawn:
a DDP with `keep_gradients_local` leaves each rank its own gradient (a plain DDP averages
them: the check can fail), DeMo trains through it with replicas bit-identical, and a
`PerRankState` checkpoint written by rank 0 alone resumes every rank's own state bit for
bit, where the framework default (rank 0's optimizer file on every rank) does not."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.dist import run_workers
from thinwire import DeMo
from thinwire.integrations import PerRankState, keep_gradients_local

STEPS, SAVE_AT = 8, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _grads(model) -> list:
    return [p.grad.clone() for p in model.parameters()]


def _train(ddp, opt, rank, start, stop):
    for step in range(start, stop):
        _loss(ddp, rank, step).backward()
        opt.step()
        opt.zero_grad()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _gradients_case(rank):
    plain, local = DistributedDataParallel(_model()), keep_gradients_local(DistributedDataParallel(_model()))
    alone = _model()
    for m in (plain, local, alone):
        _loss(m, rank, 0).backward()
    return _grads(alone), _grads(local), _grads(plain)


def _resume_case(rank, world, path):
    ddp = keep_gradients_local(DistributedDataParallel(_model()))
    opt = DeMo(ddp.parameters(), lr=1e-2, topk=4, chunk=8)
    _train(ddp, opt, rank, 0, SAVE_AT)
    blob = PerRankState(opt).state_dict()               # every rank calls it; rank 0 writes it
    framework_default = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    if rank == 0:
        torch.save({"model": ddp.module.state_dict(), "per_rank": blob, "optimizer": framework_default}, path)
    dist.barrier()
    _train(ddp, opt, rank, SAVE_AT, STEPS)
    saved = torch.load(path, weights_only=False)
    results = {}
    for how in ("per_rank", "optimizer"):               # ours, and rank 0's file on every rank
        fresh = DistributedDataParallel(_model()).module
        fresh.load_state_dict(saved["model"])
        fresh_ddp = keep_gradients_local(DistributedDataParallel(fresh))
        fresh_opt = DeMo(fresh_ddp.parameters(), lr=1e-2, topk=4, chunk=8)
        if how == "per_rank":
            PerRankState(fresh_opt).load_state_dict(saved["per_rank"])
        else:
            fresh_opt.load_state_dict(saved["optimizer"])
        _train(fresh_ddp, fresh_opt, rank, SAVE_AT, STEPS)
        results[how] = _flat(fresh_ddp.module)
    everyone = [None] * world
    dist.all_gather_object(everyone, _flat(ddp.module))
    bad_world = {**blob, "world": world + 1, "ranks": blob["ranks"] + [blob["ranks"][0]]}
    try:
        PerRankState(opt).load_state_dict(bad_world)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"whole": _flat(ddp.module), "everyone": everyone, "refused": refused, **results,
            "states_differ": not _same_state(blob["ranks"][0], blob["ranks"][1])}


def _same_state(a: dict, b: dict) -> bool:
    for key in a["state"]:
        for name, value in a["state"][key].items():
            if torch.is_tensor(value) and not torch.equal(value, b["state"][key][name]):
                return False
    return True


def _buffers_case() -> str | None:
    with_buffers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    try:
        keep_gradients_local(DistributedDataParallel(with_buffers))
    except ValueError as err:
        return str(err)
    return None


def _worker(rank, world, path):
    return {"gradients": _gradients_case(rank), "resume": _resume_case(rank, world, path), "buffers": _buffers_case()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_workers(_worker, 2, args=(str(tmp_path_factory.mktemp("per-rank") / "ckpt.pt"),))


def test_keep_gradients_local_leaves_each_rank_its_own_gradient(ranks):
    for r in ranks:
        alone, local, plain = r["gradients"]
        assert all(torch.equal(a, b) for a, b in zip(alone, local))
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["gradients"][0], ranks[1]["gradients"][0])]
    assert all(torch.allclose(m, p) for m, p in zip(mean, ranks[0]["gradients"][2]))   # plain DDP averages
    assert not all(torch.equal(a, p) for a, p in zip(ranks[0]["gradients"][0], ranks[0]["gradients"][2]))


def test_demo_through_ddp_keeps_replicas_bit_identical(ranks):
    a, b = ranks[0]["resume"]["everyone"]
    assert torch.equal(a, b)


def test_per_rank_state_resumes_every_rank_bit_for_bit(ranks):
    for r in ranks:
        assert torch.equal(r["resume"]["per_rank"], r["resume"]["whole"])
    assert ranks[0]["resume"]["states_differ"]              # rank 1's state is its own, and it survived
    assert not torch.equal(ranks[1]["resume"]["optimizer"], ranks[1]["resume"]["whole"])  # the default loses it


def test_per_rank_state_refuses_another_world_size(ranks):
    assert "holds the optimizer state of 3 ranks, this run has 2" in ranks[0]["resume"]["refused"]


def test_a_ddp_that_broadcasts_buffers_every_forward_is_refused(ranks):
    assert "broadcast_buffers=False" in ranks[0]["buffers"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="takes a torch.optim.Optimizer"):
        PerRankState(object())
    with pytest.raises(ValueError, match="takes a DistributedDataParallel"):
        keep_gradients_local(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a PerRankState checkpoint"):
        PerRankState(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)).load_state_dict({})
