"""EF21-Muon's step as a GPU would pay it, counted on CPU (`thinwire.audit`): the same launches
from 2 to 8 GPT-2 blocks (28 and 100 tensors, narrow widths: the counts depend on the tensors'
number and shapes, not their sizes) on both ranks, the server and a worker, and one host read
per step, the envelope's after the exchange. World 2, real gloo processes; the harness's
settings (benchmarks/step_configs.py's "ef21-muon": top-k 5 % up, identity down, rank 0 the
server) and its variants.

Before the flat path (per-tensor loops, `nonzero`, host draws, host checks), world 2:
rank 0 (server) 2,716 / 9,784 launches and 202 / 706 host reads at 2 / 8 blocks, rank 1
1,330 / 4,856 and 87 / 303.
"""

from __future__ import annotations

import pytest
import torch

import thinwire
from tests.dist import run_workers
from tests.optim import test_step_audit as step_audit

BUILDS = {
    "ef21-muon": lambda ps: thinwire.EF21Muon(ps, lr=0.02),
    "ef21-muon-skip": lambda ps: thinwire.EF21Muon(ps, lr=0.02, nonfinite="skip"),
    "ef21-muon-replicated": lambda ps: thinwire.EF21Muon(ps, lr=0.02, topology="replicated"),
    "ef21-muon-random": lambda ps: thinwire.EF21Muon(ps, lr=0.02, weight_decay=0.1, uplink="randk:0.05+natural",
                                                     downlink="topk:0.1+natural"),
    "ef21-muon-bf16": lambda ps: thinwire.EF21Muon(ps, lr=0.02),
    "ef21-muon-harness": lambda ps: _harness(ps),
    "torch-adamw-foreach": step_audit.BUILDS["torch-adamw-foreach"],
}
EF21 = [name for name in BUILDS if name.startswith("ef21")]


def _harness(ps):
    """The training harness's EF21-Muon (thinwire.train.optimizers): spectral hidden matrices,
    sign embeddings, rms gains, the top-44 % int8 uplink, replicated, weight decay."""
    groups = [{"params": [p for p in ps[2:] if p.dim() == 2], "lmo": "spectral"},
              {"params": ps[:2], "lmo": "sign", "lr": 3e-3}, {"params": [p for p in ps if p.dim() < 2], "lmo": "rms"}]
    return thinwire.EF21Muon(groups, lr=0.02, beta=0.3, weight_decay=0.1, uplink="topk:0.44+int8",
                             topology="replicated")
DTYPES = {"ef21-muon-bf16": torch.bfloat16}


def _audit_all(rank: int, world: int) -> dict:
    """(launches, host reads) of the last steps of a cycle of test_step_audit's (the first
    create the state and the plan), for each build at 2 and 8 blocks, on this rank."""
    saved, saved_dtypes = dict(step_audit.BUILDS), dict(step_audit.DTYPES)
    step_audit.BUILDS.update(BUILDS)
    step_audit.DTYPES.update(DTYPES)
    try:
        return {(name, blocks): step_audit._audited_cycle(rank, world, name, blocks) for name in BUILDS
                for blocks in (2, 8)}
    finally:
        step_audit.BUILDS.clear()
        step_audit.BUILDS.update(saved)
        step_audit.DTYPES.clear()
        step_audit.DTYPES.update(saved_dtypes)


@pytest.fixture(scope="module")
def audited():
    """Both ranks' counts: rank 0 serves (topology 'server'), rank 1 only works."""
    return run_workers(_audit_all, 2)


@pytest.mark.parametrize("name", EF21)
def test_launches_do_not_grow_with_the_number_of_tensors(audited, name):
    for rank, counts in enumerate(audited):
        assert counts[(name, 2)] == counts[(name, 8)], (rank, counts[(name, 2)], counts[(name, 8)])


@pytest.mark.parametrize("name", EF21)
def test_a_step_reads_the_host_once_and_with_skip_not_at_all(audited, name):
    """The envelope's one read after the exchange: the answer's (or every rank's) header with
    the arrival flags; no read of this rank's gradients, of what was decoded or of top-k.
    nonfinite='skip': none, the step lands under the device's verdict (`_apply_masked`)."""
    reads = 0 if name.endswith("skip") else 1
    for counts in audited:
        assert [r for _, r in counts[(name, 8)]] == [reads] * len(counts[(name, 8)])


def test_launches_against_torch_adamw_foreach(audited):
    """At 8 blocks, against torch's AdamW (foreach) as the audit counts it (one launch per
    foreach call, 8 a step): the worker's step within 16x, the server's (which also decodes
    every rank's message and runs Newton–Schulz once per matrix shape: 4 here, 6 in GPT-2) within
    40x. The issue's goal, 6x, is not met here; on a GPU, where a CPU top-k's two-level
    selection (`ops.select`, 8 launches a block here) is one top-k and AdamW's foreach calls
    chunk into several launches (56 for GPT-2 small on an H100), the ratio is smaller."""
    adamw = max(n for n, _ in audited[0][("torch-adamw-foreach", 8)])
    server, worker = audited[0][("ef21-muon", 8)], audited[1][("ef21-muon", 8)]
    assert max(n for n, _ in worker) <= 16 * adamw, (worker, adamw)
    assert max(n for n, _ in server) <= 40 * adamw, (server, adamw)


def test_bf16_parameters_launch_about_what_float32_ones_do(audited):
    """A bf16 model's step: float32's launches plus a few whole-buffer casts, never per tensor."""
    for counts in audited:
        for (bf16, _), (fp32, _) in zip(counts[("ef21-muon-bf16", 8)], counts[("ef21-muon", 8)]):
            assert bf16 <= fp32 + 12, (bf16, fp32)
