"""Communicator collectives on real gloo process groups: results and byte accounting."""

import pytest
import torch

from tests.dist import run_workers
from thinwire.comm import Communicator, link_bytes


def _exercise(rank, world):
    comm = Communicator()
    out = {}
    # all_reduce: sum of (rank + 1) over ranks.
    x = torch.full((6,), float(rank + 1))
    out["all_reduce"] = comm.all_reduce(x).clone()
    m = torch.tensor([rank * 7 % 5], dtype=torch.uint8)
    out["all_reduce_max"] = comm.all_reduce(m, op="max", tag="control").clone()
    # all_gather of uint8 buffers, async.
    g = torch.full((5,), rank, dtype=torch.uint8)
    out["all_gather"] = comm.all_gather(g, async_op=True).wait().clone()
    # all_to_all: part j of rank r holds 10*r + j.
    parts = torch.arange(world, dtype=torch.int32).repeat_interleave(3) + 10 * rank
    out["all_to_all"] = comm.all_to_all(parts).clone()
    out["all_to_all_own_kept"] = comm.all_to_all(parts, send_own=False, async_op=True).wait().clone()
    out["gather"] = comm.gather(torch.full((2,), rank + 100, dtype=torch.int64), dst=world - 1)
    b = torch.full((4,), float(rank))
    out["broadcast"] = comm.broadcast(b, src=world - 1).clone()
    out["stats"] = comm.stats.state_dict()
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_and_accounting(world):
    results = run_workers(_exercise, world)
    for rank, out in enumerate(results):
        assert torch.equal(out["all_reduce"], torch.full((6,), world * (world + 1) / 2))
        assert out["all_reduce_max"].item() == max(r * 7 % 5 for r in range(world))
        assert torch.equal(out["all_gather"], torch.arange(world, dtype=torch.uint8)[:, None].expand(world, 5))
        expected_a2a = torch.tensor([[10 * src + rank] * 3 for src in range(world)], dtype=torch.int32)
        assert torch.equal(out["all_to_all"], expected_a2a)
        assert torch.equal(out["all_to_all_own_kept"], expected_a2a)
        if rank == world - 1:
            assert torch.equal(out["gather"], (torch.arange(world) + 100)[:, None].expand(world, 2))
        else:
            assert out["gather"] is None
        assert torch.equal(out["broadcast"], torch.full((4,), float(world - 1)))

        root = rank == world - 1
        calls = [("all_reduce", 24, False), ("all_reduce", 1, False), ("all_gather", 5, False),
                 ("all_to_all", 12 * world, False), ("all_to_all", 12 * world, False), ("gather", 16, root),
                 ("broadcast", 16, root)]
        sent = sum(link_bytes(op, n, world, is_root=r)[0] for op, n, r in calls)
        received = sum(link_bytes(op, n, world, is_root=r)[1] for op, n, r in calls)
        # send_own=False hands torch.distributed only the 12 (W - 1) bytes bound for peers
        payload = 24 + 1 + 5 + 12 * world + 12 * (world - 1) + 16 + (16 if root else 0)
        totals = out["stats"]["totals"]
        assert totals == {"payload_bytes": payload, "link_bytes_sent": sent,
                          "link_bytes_received": received, "collectives": 7}
        assert out["stats"]["by_tag"]["control"]["payload_bytes"] == 1


def test_single_process_without_process_group():
    comm = Communicator()
    assert (comm.rank, comm.world_size) == (0, 1)
    x = torch.arange(4.0)
    assert torch.equal(comm.all_reduce(x), torch.arange(4.0))
    assert torch.equal(comm.all_gather(x), x[None])
    assert comm.stats.link_bytes_sent == 0 and comm.stats.payload_bytes == 32


def test_last_step_counts_only_since_begin_step():
    comm = Communicator()
    comm.all_reduce(torch.zeros(10))
    comm.stats.begin_step()
    comm.all_reduce(torch.zeros(3))
    assert comm.stats.last_step.payload_bytes == 12 and comm.stats.payload_bytes == 52
    assert comm.stats.last_step.collectives == 1 and comm.stats.collectives == 2


def test_bad_buffers_raise():
    comm = Communicator()
    with pytest.raises(ValueError, match="1-D"):
        comm.all_reduce(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="op"):
        comm.all_reduce(torch.zeros(2), op="min")
    with pytest.raises(ValueError, match="dst"):
        comm.gather(torch.zeros(2), dst=3)


# ---- the blocked-time observer (Communicator.set_blocked_observer) ----------------------------

DELAY = 0.5          # rank 1 starts some collectives this late, so rank 0 must block for about as long


class _NoClock:
    """Stands in for communicator.py's `time`: reading the clock fails the test."""

    def perf_counter(self):
        raise AssertionError("the communicator read the clock with no observer set")


def _observed(rank, world):
    import time

    import thinwire.comm.communicator as communicator
    assert Communicator.set_blocked_observer(None) is None                  # unset by default
    real_time, communicator.time = communicator.time, _NoClock()
    try:
        unobserved = _exercise(rank, world)                                  # unset: no clock read at all
    finally:
        communicator.time = real_time

    calls = []
    assert Communicator.set_blocked_observer(lambda op, s: calls.append((op, s))) is None
    observed = _exercise(rank, world)
    n_exercise = len(calls)

    comm = Communicator()
    mark = len(calls)
    if rank == 1:
        time.sleep(DELAY)
    comm.all_reduce(torch.ones(3))                                           # synchronous: rank 0 waits here
    sync_late = calls[mark:]
    mark = len(calls)
    if rank == 1:
        time.sleep(DELAY)
    pending = comm.all_gather(torch.ones(3), async_op=True)
    issued = calls[mark:]
    pending.wait()
    pending.wait()                                                           # a second wait reports nothing
    async_late = calls[mark:]
    mark = len(calls)
    if rank == 1:
        time.sleep(DELAY)
    comm.all_to_all(torch.arange(4.0), send_own=False, async_op=True).wait()  # the _Assemble path
    assemble_late = calls[mark:]

    previous = Communicator.set_blocked_observer(None)
    mark = len(calls)
    comm.all_reduce(torch.ones(3))
    return {"unobserved": unobserved, "observed": observed, "calls": calls[:n_exercise], "sync": sync_late,
            "issued": issued, "async": async_late, "assemble": assemble_late, "after_unset": calls[mark:],
            "previous_was_set": previous is not None}


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_blocked_observer_sees_each_collective_on_gloo():
    for rank, out in enumerate(run_workers(_observed, 2)):
        assert _same(out["unobserved"], out["observed"])                       # observing changes no result
        # _exercise: 5 synchronous collectives (one report each) and 2 async ones (issue + wait)
        assert [op for op, _ in out["calls"]] == [
            "all_reduce", "all_reduce", "all_gather", "all_gather", "all_to_all", "all_to_all", "all_to_all",
            "gather", "broadcast"]
        assert all(s >= 0 for _, s in out["calls"])
        assert [op for op, _ in out["sync"]] == ["all_reduce"]
        assert [op for op, _ in out["issued"]] == ["all_gather"]
        assert [op for op, _ in out["async"]] == ["all_gather", "all_gather"]
        assert [op for op, _ in out["assemble"]] == ["all_to_all", "all_to_all"]
        assert out["after_unset"] == [] and out["previous_was_set"]
        if rank == 0:                                      # rank 0 blocked until the late rank 1 arrived
            assert out["sync"][0][1] >= DELAY / 2
            assert out["async"][1][1] >= DELAY / 2          # ... in Pending.wait()
            assert out["assemble"][1][1] >= DELAY / 2       # ... in Pending.wait() -> _Assemble.wait()


def test_blocked_observer_not_called_without_process_group():
    calls = []
    previous = Communicator.set_blocked_observer(lambda op, s: calls.append(op))
    try:
        comm = Communicator()
        comm.all_reduce(torch.ones(2))
        comm.all_gather(torch.ones(2), async_op=True).wait()
    finally:
        Communicator.set_blocked_observer(previous)
    assert calls == []
