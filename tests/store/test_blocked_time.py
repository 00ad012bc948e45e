"""A store round is timed as a torch.distributed all_gather is (comm.Communicator's
`set_blocked_observer` rules): a synchronous round once, from issue to its answer; an
async one once when issued and once when first waited on. One site of two, the other never
comes, so each round waits out its deadline: a known, measurable block."""

from __future__ import annotations

import torch

from thinwire.comm import Communicator
from thinwire.store import StoreGroup

from .sites import CONFIG, KEY

DEADLINE = 0.5          # round_timeout, seconds: what each round blocks for


def test_a_store_round_reports_its_blocked_time_as_an_all_gather(tmp_path):
    reports = []
    previous = Communicator.set_blocked_observer(lambda op, seconds: reports.append((op, seconds)))
    try:
        comm = StoreGroup(tmp_path.as_uri(), "site-a", ["site-a", "site-b"], KEY, CONFIG,
                          round_timeout=DEADLINE).communicator()
        buf = torch.arange(8, dtype=torch.uint8)
        comm.all_gather(buf)                                # synchronous: one report, the whole round
        assert [op for op, _ in reports] == ["all_gather"] and reports[0][1] >= DEADLINE
        pending = comm.all_gather(buf, async_op=True)       # async: the issue only, no waiting
        assert len(reports) == 2 and reports[1][1] < DEADLINE / 2
        pending.wait()
        pending.wait()                                      # a second wait blocks on nothing: not reported
        assert [op for op, _ in reports] == ["all_gather"] * 3 and reports[2][1] >= DEADLINE / 2
        assert pending.absent == (1,)                       # site-b (rank 1) never came: its row absent
    finally:
        Communicator.set_blocked_observer(previous)
