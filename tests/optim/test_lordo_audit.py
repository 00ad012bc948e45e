"""LoRDO's step as a GPU would pay for it, counted on CPU (`thinwire.audit`, issue 47): GPT-2
shapes (width 16: the counts depend on the tensors' number and shapes, not their sizes) at 2
and 8 blocks (28 and 100 tensors), rank 4, K 4, world 2 in real gloo processes.

The stacked path (`thinwire.optim.lordo_groups`) launches as many kernels at 8 blocks as at 2,
local step and sync alike. No local step reads the host: it runs under this rank's non-finite
flag on the device (`_masks_nonfinite`; the step counts of a skipped one are taken back a call
later). With nonfinite='raise' the sync reads once (the envelope's check of what was delivered,
the flags included); with 'skip' the fp32 sync lands under the device's verdict and the bases'
refresh with it, and no step reads at all (the batched SVD's own synchronisation on a GPU is
not an op the audit sees). Before: 1 read per local step and 2 per sync (the envelope's check of
this rank's gradients, then of the delivery), with 'skip' too; and before the stacks (one matrix
at a time, a `float(mean(D))` and the clip's norms read per step) 364 / 1,276 launches and 12 /
36 reads per local step at 2 / 8 blocks. The per-tensor path (`grouped = False`, what FSDP2
shards take) reads no more than the stacked one, but its launches grow with the tensors."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

import thinwire
from tests.dist import run_workers
from tests.optim import test_step_audit as step_audit

BLOCKS = (2, 8)
SYNC_EVERY = step_audit.SYNC_EVERY            # 4: `step_audit._audited_cycle` counts the third cycle


def _lordo(nonfinite: str = "raise", stacked: bool = True):
    def build(params):
        opt = thinwire.LoRDO(params, lr=1e-3, rank=4, sync_every=SYNC_EVERY, weight_decay=0.1, nonfinite=nonfinite)
        opt.grouped = stacked
        return opt
    return build


BUILDS = {"fp32": _lordo(), "bf16": _lordo(), "fp32-skip": _lordo("skip"), "per-tensor": _lordo(stacked=False)}


def _all(rank: int, world: int) -> dict:
    """(launches, host reads) of each step of a steady-state cycle (the last one the sync), by
    (build, blocks), through test_step_audit's loop."""
    with patch.dict(step_audit.BUILDS, BUILDS), patch.dict(step_audit.DTYPES, {"bf16": torch.bfloat16}):
        return {(name, blocks): step_audit._audited_cycle(rank, world, name, blocks)
                for name in BUILDS for blocks in BLOCKS}


@pytest.fixture(scope="module")
def audited():
    return run_workers(_all, 2)[0]


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp32-skip"])
def test_launches_do_not_grow_with_the_number_of_tensors(audited, name):
    two, eight = audited[(name, 2)], audited[(name, 8)]
    assert two == eight, (two, eight)                         # every step: launches and reads
    local = [n for n, _ in two[:-1]]
    # every local step alike, but 'raise' ORs each one's flag into the one it carries to the
    # sync (the envelope's `_local`): one launch more from the second local step on
    assert local == [local[0]] + [local[0] + (name != "fp32-skip")] * (len(local) - 1), local


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_raise_reads_the_host_once_at_the_sync_and_never_on_a_local_step(audited, name):
    for blocks in BLOCKS:
        reads = [r for _, r in audited[(name, blocks)]]
        assert reads == [0] * (SYNC_EVERY - 1) + [1], (blocks, reads)


def test_skip_reads_the_host_on_no_step(audited):
    for blocks in BLOCKS:
        reads = [r for _, r in audited[("fp32-skip", blocks)]]
        assert reads == [0] * SYNC_EVERY, (blocks, reads)


def test_stacked_launches_are_a_fraction_of_the_per_tensor_paths(audited):
    """At 8 blocks the per-tensor path launches several times more, growing with the tensors;
    it reads the host no more often (its clip and mean(D) stay on the device too)."""
    stacked, each = audited[("fp32", 8)], audited[("per-tensor", 8)]
    assert all(4 * a < b for (a, _), (b, _) in zip(stacked, each)), (stacked, each)
    assert audited[("per-tensor", 2)][0][0] < each[0][0]
    assert [r for _, r in each] == [r for _, r in stacked]


def test_bf16_launches_within_a_few_of_float32s_per_stack(audited):
    """bf16 parameters: float32's launches plus a few casts per stack (7 stacks), never per tensor."""
    for (bf16, _), (fp32, _) in zip(audited[("bf16", 8)], audited[("fp32", 8)]):
        assert fp32 <= bf16 <= fp32 + 4 * 7, (bf16, fp32)
