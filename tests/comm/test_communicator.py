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
