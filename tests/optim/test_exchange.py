"""thinwire.optim.exchange.GatherAll: a large message leaves as a few all_gathers in flight at
once (`gather_parts`) and arrives whole, every rank's bytes in rank order, counted once."""

from __future__ import annotations

import pytest
import torch

from thinwire.comm import Communicator
from thinwire.optim.exchange import MAX_PARTS, PART_BYTES, GatherAll, gather_parts
from thinwire.optim.protocol import prefix_nbytes
from tests.dist import run_workers

LARGE = 3 * PART_BYTES + 1234          # four parts: three full, one short


@pytest.mark.parametrize("nbytes", [0, 1, PART_BYTES, PART_BYTES + 1, LARGE, 129_056, 10 ** 6])
def test_parts_cover_the_message_in_order(nbytes):
    parts = gather_parts(nbytes)
    assert len(parts) == max(1, min(MAX_PARTS, -(-nbytes // PART_BYTES)))
    assert parts[0].start == 0 and parts[-1].stop == nbytes
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))          # contiguous, no byte twice
    sizes = [p.stop - p.start for p in parts]
    assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]               # equal but for the last


def _gather(rank: int, world: int) -> dict:
    comm = Communicator()
    message = GatherAll(comm)
    payload = message.resize(n_params=1, payload_nbytes=LARGE, device="cpu")
    # a pattern that differs by rank and by byte, so a part out of place shows
    payload.copy_((torch.arange(LARGE) * (rank + 3) % 251).to(torch.uint8))
    message.seal(step=7, flags=0, present=[True])
    message.start()
    delivery = message.finish(step=7)
    last = comm.stats.by_tag["payload"]
    return {"data": delivery.data.clone(), "flagged": delivery.flagged, "collectives": last.collectives,
            "payload_bytes": last.payload_bytes}


def test_a_large_message_arrives_whole_from_every_rank():
    sent_bytes = prefix_nbytes(1) + LARGE
    for got in run_workers(_gather, 2):
        assert got["flagged"] == []
        for r in range(2):
            assert torch.equal(got["data"][r], (torch.arange(LARGE) * (r + 3) % 251).to(torch.uint8)), r
        assert got["collectives"] == len(gather_parts(sent_bytes)) == MAX_PARTS
        assert got["payload_bytes"] == sent_bytes                             # every byte counted once
