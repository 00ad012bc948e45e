"""The framework-agnostic pieces (thinwire.integrations) on 2 real gloo processes, one spawn:
a DDP with `keep_gradients_local` leaves each rank its own gradient (a plain DDP averages
them: the check can fail), DeMo trains through it with replicas bit-identical, and a
`PerRankState` checkpoint written by rank 0 alone resumes every rank's own state bit for
bit, where the framework default (rank 0's optimizer file on every rank) does not; a
`CollectiveCounter` sees DDP's gradient all-reduce in backward (the bytes of every gradient,
each step) and none under `keep_gradients_local`, and the optimizer's own bytes as its
`comm_stats` counts them. In one process: a `PerRankState` entry names its rank, run and
layout, and one of another rank, another run (same settings, another seed) or another layout
(LoRDO into DeMo) is refused naming both, before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.dist import run_workers
from thinwire import DeMo, DiLoCo
from thinwire.integrations import CollectiveCounter, PerRankState, keep_gradients_local

STEPS, SAVE_AT = 9, 4          # DiLoCo syncs after steps 3, 6, 9: the run ends on a sync, the checkpoint falls between two
OPTIMIZERS = {"demo": lambda ps: DeMo(ps, lr=1e-2, topk=4, chunk=8),
              "diloco": lambda ps: DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-2), sync_every=3)}


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


def _resume_case(rank, world, path, name):
    make = OPTIMIZERS[name]
    ddp = keep_gradients_local(DistributedDataParallel(_model()))
    opt = make(ddp.parameters())
    _train(ddp, opt, rank, 0, SAVE_AT)
    blob = PerRankState(opt).state_dict()               # every rank calls it; rank 0 writes it
    framework_default = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    if rank == 0:
        torch.save({"model": ddp.module.state_dict(), "per_rank": blob, "optimizer": framework_default}, path)
    dist.barrier()
    _train(ddp, opt, rank, SAVE_AT, STEPS)
    opt.flush()
    saved = torch.load(path, weights_only=False)
    results = {}
    for how in ("per_rank", "optimizer"):               # ours, and rank 0's file on every rank
        fresh = DistributedDataParallel(_model()).module
        fresh.load_state_dict(saved["model"])
        fresh_ddp = keep_gradients_local(DistributedDataParallel(fresh))
        fresh_opt = make(fresh_ddp.parameters())
        if how == "per_rank":
            PerRankState(fresh_opt).load_state_dict(saved["per_rank"])
        else:
            fresh_opt.load_state_dict(saved["optimizer"])
        _train(fresh_ddp, fresh_opt, rank, SAVE_AT, STEPS)
        fresh_opt.flush()
        results[how] = _flat(fresh_ddp.module)
    everyone = [None] * world
    dist.all_gather_object(everyone, _flat(ddp.module))
    other = keep_gradients_local(DistributedDataParallel(_model()))
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)    # a torch optimizer's per-rank state
    _train(other, sgd, rank, 0, 1)
    sgd_blob = PerRankState(sgd).state_dict()
    try:
        three = {**sgd_blob, "world": world + 1, "ranks": sgd_blob["ranks"] + sgd_blob["ranks"][:1],
                 "identities": sgd_blob["identities"] + sgd_blob["identities"][:1]}
        PerRankState(sgd).load_state_dict(three)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"whole": _flat(ddp.module), "everyone": everyone, "refused": refused, "blob": blob, **results,
            "states_differ": not _same_state(blob["ranks"][0], blob["ranks"][1])}


def _same_state(a, b) -> bool:
    """Whether two saved states hold equal tensors everywhere (nested dicts and lists)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return True


def _refused(build) -> str | None:
    try:
        build()
    except ValueError as err:
        return str(err)
    return None


def _buffers_case() -> dict:
    """keep_gradients_local on a DDP that syncs buffers every forward (refused, or stopped when
    asked: by forward_sync_buffers, then no sync before a forward) and one that looks for unused
    parameters (refused)."""
    with_buffers = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    stopped = keep_gradients_local(DistributedDataParallel(with_buffers()), stop_buffer_sync=True)
    return {"buffers": _refused(lambda: keep_gradients_local(DistributedDataParallel(with_buffers()))),
            "stopped": (stopped.forward_sync_buffers, stopped.will_sync_module_buffers()),
            "unused": _refused(lambda: keep_gradients_local(
                DistributedDataParallel(_model(), find_unused_parameters=True)))}


def _wire_case(rank, steps=3):
    out = {}
    for how in ("plain", "local"):
        counter = CollectiveCounter()
        with counter:
            ddp = DistributedDataParallel(_model(), broadcast_buffers=False)
            if how == "local":
                keep_gradients_local(ddp)
            opt = DeMo(ddp.parameters(), lr=1e-2, topk=4, chunk=8)
            counter.attribute(opt)
            _train(ddp, opt, rank, 0, steps)
            opt.flush()
        out[how] = {"summary": counter.summary(), "payload": opt.comm_stats.payload_bytes,
                    **{label: counter.bytes(label) for label in ("optimizer", "backward", "other")}}
    counter = CollectiveCounter()                   # step(closure) runs backward: Lightning's way
    with counter:
        ddp = DistributedDataParallel(_model(), broadcast_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        counter.attribute(opt)
        opt.step(lambda: _loss(ddp, rank, 0).backward())
    out["closure"] = counter.summary()
    with CollectiveCounter() as rules:
        t = torch.ones(10)                                              # 40 bytes
        dist.broadcast(t, src=0)
        dist.all_gather_into_tensor(torch.empty(20), t)
        dist.barrier()
    out["rules"] = rules.summary()
    return out


def _worker(rank, world, root):
    return {"gradients": _gradients_case(rank), "buffers": _buffers_case(), "wire": _wire_case(rank),
            **{name: _resume_case(rank, world, f"{root}/{name}.pt", name) for name in OPTIMIZERS}}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_workers(_worker, 2, args=(str(tmp_path_factory.mktemp("per-rank")),))


def test_keep_gradients_local_leaves_each_rank_its_own_gradient(ranks):
    for r in ranks:
        alone, local, plain = r["gradients"]
        assert all(torch.equal(a, b) for a, b in zip(alone, local))
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["gradients"][0], ranks[1]["gradients"][0])]
    assert all(torch.allclose(m, p) for m, p in zip(mean, ranks[0]["gradients"][2]))   # plain DDP averages
    assert not all(torch.equal(a, p) for a, p in zip(ranks[0]["gradients"][0], ranks[0]["gradients"][2]))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_replicas_bit_identical_through_ddp(ranks, name):
    a, b = ranks[0][name]["everyone"]          # DiLoCo: right after its last sync
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_per_rank_state_resumes_every_rank_bit_for_bit(ranks, name):
    """DeMo: each rank's momentum; DiLoCo, saved between syncs: each rank's inner state and its
    own diverged parameters, copied back over rank 0's saved model."""
    for r in ranks:
        assert torch.equal(r[name]["per_rank"], r[name]["whole"])
    assert ranks[0][name]["states_differ"]                 # rank 1's state is its own, and it survived
    assert not torch.equal(ranks[1][name]["optimizer"], ranks[1][name]["whole"])  # the default loses it


def test_per_rank_state_refuses_another_world_size_for_a_torch_optimizer(ranks):
    assert "only a thinwire optimizer's per-rank state can be mapped" in ranks[0]["demo"]["refused"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_per_rank_state_of_two_ranks_loads_on_one_by_the_interval_rule(ranks, name):
    """W = 2 -> W' = 1: the one new rank takes the mean of the two ranks' per-rank state
    (DeMo's momentum; DiLoCo's own parameters, saved between syncs), replicated state as is."""
    blob = ranks[0][name]["blob"]
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    PerRankState(opt).load_state_dict(blob)                           # this process: world 1
    if name == "demo":
        saved = [r["state"] for r in blob["ranks"]]
        for k, state in opt.state_dict()["state"].items():
            assert torch.allclose(state["momentum"], (saved[0][k]["momentum"] + saved[1][k]["momentum"]) / 2)
        assert not torch.equal(saved[0][0]["momentum"], saved[1][0]["momentum"])      # there was something to mix
    else:
        first, second = (r["params"] for r in blob["ranks"])
        for p, a, b in zip(model.parameters(), first, second):
            assert torch.allclose(p.detach(), (a + b) / 2)
        assert not all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_ddp_that_broadcasts_buffers_every_forward_is_refused_or_stopped(ranks):
    assert "broadcast_buffers=False" in ranks[0]["buffers"]["buffers"]
    assert ranks[0]["buffers"]["stopped"] == (False, False)           # the flag off, and no sync before a forward


def test_a_ddp_that_finds_unused_parameters_is_refused(ranks):
    assert "find_unused_parameters=True" in ranks[0]["buffers"]["unused"]


def test_collective_counter_sees_ddp_gradients_in_backward_and_none_when_local(ranks):
    grad_bytes = 4 * sum(p.numel() for p in _model().parameters())      # fp32 gradients, all of them
    for rank, r in enumerate(ranks):
        plain, local = r["wire"]["plain"], r["wire"]["local"]
        assert plain["backward"] == 3 * grad_bytes                       # one all-reduce of every gradient per step
        assert plain["summary"]["backward"]["allreduce_"]["calls"] == 3
        assert local["backward"] == 0 and "backward" not in local["summary"]
        for run in (plain, local):
            assert run["optimizer"] == run["payload"] > 0                # two counts of the same bytes agree
            assert run["summary"]["optimizer_steps"] == 3
            startup = run["summary"]["other"]["broadcast_"]["largest"]   # DDP's start-up broadcast, from rank 0
            assert startup == (grad_bytes if rank == 0 else 0)


def test_a_backward_inside_step_closure_is_counted_as_backward(ranks):
    grad_bytes = 4 * sum(p.numel() for p in _model().parameters())
    for r in ranks:
        closure = r["wire"]["closure"]
        assert closure["backward"]["allreduce_"]["bytes"] == grad_bytes and "optimizer" not in closure
        assert closure["optimizer_steps"] == 1


def test_collective_counter_counts_what_a_rank_sends(ranks):
    for rank, r in enumerate(ranks):
        other = r["wire"]["rules"]["other"]
        assert other["broadcast_"]["bytes"] == (40 if rank == 0 else 0)  # only the source sends
        assert other["_allgather_base_"]["bytes"] == 40                  # this rank's contribution
        assert other["barrier"]["bytes"] == 0 and other["barrier"]["calls"] == 1


def _blob(make, seed=0):
    """A one-rank PerRankState checkpoint of `make`'s optimizer after one step, and that optimizer."""
    torch.manual_seed(seed)
    model = _model()
    opt = make(model.parameters())
    _loss(model, 0, 0).backward()
    opt.step()
    return PerRankState(opt).state_dict(), opt


def test_per_rank_state_names_whose_state_each_entry_is(ranks):
    blob = ranks[0]["demo"]["blob"]
    assert [i["rank"] for i in blob["identities"]] == [0, 1] and {i["world"] for i in blob["identities"]} == {2}
    assert blob["run"] and {i["run"] for i in blob["identities"]} == {blob["run"]}      # agreed: rank 0's token
    assert blob["run"] != ranks[0]["diloco"]["blob"]["run"]                              # another run, another id


def test_per_rank_state_refuses_another_ranks_state_naming_both():
    blob, _ = _blob(OPTIMIZERS["demo"])
    blob["identities"][0] = {**blob["identities"][0], "rank": 1}          # rank 1's state where rank 0's belongs
    fresh = PerRankState(OPTIMIZERS["demo"](_model().parameters()))
    before = copy.deepcopy(fresh.optimizer.state_dict())
    with pytest.raises(ValueError, match=r"holds rank 1 of 1 in run .*; this is rank 0 of 1 .*another rank's state"):
        fresh.load_state_dict(blob)
    assert _same_state(before, fresh.optimizer.state_dict())                # nothing changed


def test_per_rank_state_refuses_another_runs_state_naming_both():
    """Same settings, another seed: a file of another run, refused once this run has its id
    (it saved before, or a helper took it from the checkpoint's commit mark)."""
    mine, opt = _blob(OPTIMIZERS["demo"], seed=0)
    other, _ = _blob(OPTIMIZERS["demo"], seed=1)
    assert mine["run"] != other["run"]
    with pytest.raises(ValueError, match=rf"run {other['run']}.*this is rank 0 of 1 in run {mine['run']}.*another run"):
        PerRankState(opt).load_state_dict(other)
    PerRankState(opt).load_state_dict(mine)                               # its own run's loads


def test_per_rank_state_refuses_another_layout():
    """A LoRDO run's state into a DeMo run: another optimizer and layout, refused before the
    DeMo optimizer or the parameters change."""
    from thinwire import LoRDO
    lordo, _ = _blob(lambda ps: LoRDO(ps, lr=1e-2, rank=2, sync_every=2))
    demo = PerRankState(OPTIMIZERS["demo"](_model().parameters()), params=True)
    with pytest.raises(ValueError, match=r"\(LoRDO, layout \w+\); this is .*\(DeMo, layout \w+\).*another optimizer"):
        demo.load_state_dict(lordo)
    assert torch.equal(_flat(_model()), torch.cat([p.detach().reshape(-1) for p in demo._own_params()]))
    with pytest.raises(ValueError, match="older thinwire, without per-rank identities"):
        demo.load_state_dict({**lordo, "version": None})        # a checkpoint from before identities


def test_bad_arguments():
    with pytest.raises(ValueError, match="takes a torch.optim.Optimizer"):
        PerRankState(object())
    with pytest.raises(ValueError, match="takes a DistributedDataParallel"):
        keep_gradients_local(torch.nn.Linear(2, 2))

    with pytest.raises(ValueError, match="attribute takes a torch.optim.Optimizer"):
        CollectiveCounter().attribute(object())
    with pytest.raises(ValueError, match="not a PerRankState checkpoint"):
        PerRankState(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)).load_state_dict({})


def test_the_core_imports_no_framework_and_each_framework_loads_on_first_use():
    import subprocess
    import sys
    code = ("import sys, thinwire, thinwire.integrations as ti\n"
            "assert not {'transformers', 'lightning', 'accelerate'} & set(sys.modules), 'a framework was imported'\n"
            "assert ti.ThinwireDDPStrategy.__module__ == 'thinwire.integrations.lightning'\n"
            "assert ti.ThinwireTrainer.__module__ == 'thinwire.integrations.hf_trainer'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


END_WORKER = """
import atexit, sys, tempfile
import torch.distributed as dist
from thinwire.integrations import end_worker
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
atexit.register(lambda: print("finalized"))
destroy = dist.destroy_process_group
def watched(*args):
    destroy(*args)
    print("destroyed" if not dist.is_initialized() else "still up", end="")
dist.destroy_process_group = watched
print("trained ", end="")                       # buffered: end_worker must flush it
end_worker(3)
print("after")
"""


def test_end_worker_destroys_the_group_and_skips_finalization():
    """The group destroyed, the exit code it is given, stdout flushed, and neither the code
    after it nor the interpreter's finalization (an atexit handler) runs."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", END_WORKER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "trained destroyed", done.stdout
