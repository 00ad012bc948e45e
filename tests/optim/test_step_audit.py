"""The envelope's and the grouped optimizers' cost per step as a GPU would pay it, counted on CPU (`thinwire.audit`):
its prefix and trailer are sealed without a copy from the host and read in one host read,
and the grouped optimizers' steps launch a number of kernels that does not grow with the
number of parameter tensors (GPT-2 shapes at 2 and 8 blocks, narrow widths: the counts
depend on the tensors' number and grouping, not their sizes). World 2, real gloo processes."""

from __future__ import annotations

import pytest
import torch

import thinwire
from tests.dist import run_workers
from thinwire.audit import StepAudit
from thinwire.optim.protocol import PrefixWriter, TrailerWriter, write_prefix, write_trailer

SYNC_EVERY = 4


def _gpt2_shapes(blocks: int, d: int = 16, vocab: int = 64, context: int = 16) -> list[tuple[int, ...]]:
    shapes = [(vocab, d), (context, d)]
    for _ in range(blocks):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


BUILDS = {
    "torch-adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "dense-adamw": lambda ps: thinwire.DenseAllReduce(torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
    "diloco": lambda ps: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-3, foreach=True),
                                         sync_every=SYNC_EVERY),
    "demo": lambda ps: thinwire.DeMo(ps, lr=1e-3, topk=8, chunk=16),
    "demo-lookahead": lambda ps: thinwire.DeMo(ps, lr=1e-3, topk=8, chunk=16, overlap=True, lookahead="momentum"),
    "dense-fused-skip": lambda ps: thinwire.DenseAllReduce(torch.optim.AdamW(ps, lr=1e-3, fused=True),
                                                           nonfinite="skip"),
    "demo-skip": lambda ps: thinwire.DeMo(ps, lr=1e-3, topk=8, chunk=16, weight_decay=0.1, nonfinite="skip"),
    "demo-lookahead-skip": lambda ps: thinwire.DeMo(ps, lr=1e-3, topk=8, chunk=16, overlap=True,
                                                    lookahead="momentum", nonfinite="skip"),
    "diloco-fused": lambda ps: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-3, fused=True),
                                               sync_every=SYNC_EVERY),
    "diloco-fused-skip": lambda ps: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-3, fused=True),
                                                    sync_every=SYNC_EVERY, nonfinite="skip"),
}
# bf16 parameters: the same builds; every flat buffer meets them through whole-buffer casts, since
# torch's foreach ops loop tensor by tensor over mixed dtypes (the audit counts those per tensor)
BF16 = ["dense-adamw", "demo", "diloco"]
BUILDS.update({f"{name}-bf16": BUILDS[name] for name in BF16})
GROUPED = ["dense-adamw", "diloco", "demo", "demo-lookahead", "dense-fused-skip", "demo-skip", "demo-lookahead-skip",
           "diloco-fused", "diloco-fused-skip"] + [f"{name}-bf16" for name in BF16]
# host reads per step with nonfinite='raise': the status every rank's message carried (DeMo's arrived
# payloads' validity read with it); DiLoCo's local update first reads this rank's finiteness
READS = {"dense-adamw": 1, "diloco": 2, "demo": 1, "demo-lookahead": 1,
         # nonfinite='skip': none; the step is applied under the device's verdict (`thinwire.optim.verdict`)
         "dense-fused-skip": 0, "demo-skip": 0, "demo-lookahead-skip": 0,
         # a fused inner optimizer skips a bad local step on the device: only the sync reads
         "diloco-fused": 1, "diloco-fused-skip": 0,
         **{f"{name}-bf16": reads for name, reads in (("dense-adamw", 1), ("demo", 1), ("diloco", 2))}}


DTYPES: dict[str, torch.dtype] = {f"{name}-bf16": torch.bfloat16 for name in BF16}   # builds not in float32


def _audited_cycle(rank: int, world: int, name: str, blocks: int) -> list[tuple[int, int]]:
    """(launches, host reads) of each step of one steady-state cycle of `name` on this rank."""
    gen, dtype = torch.Generator().manual_seed(0), DTYPES.get(name, torch.float32)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in _gpt2_shapes(blocks)]
    opt = BUILDS[name](params)
    counts = []
    for step in range(3 * SYNC_EVERY):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * (1 + rank)).to(dtype)
        audit = StepAudit(host_tensors=StepAudit.host_steps(opt))
        with audit:
            opt.step()
        if step >= 2 * SYNC_EVERY:                    # the first cycles create state
            counts.append((audit.launches, audit.host_reads))
    return counts


def _audit_all(rank: int, world: int) -> dict:
    return {(name, blocks): _audited_cycle(rank, world, name, blocks) for name in BUILDS for blocks in (2, 8)}


@pytest.fixture(scope="module")
def audited():
    return run_workers(_audit_all, 2)[0]


@pytest.mark.parametrize("name", GROUPED)
def test_launches_do_not_grow_with_the_number_of_tensors(audited, name):
    assert audited[(name, 2)] == audited[(name, 8)]           # 28 and 100 tensors: every step the same


@pytest.mark.parametrize("name", GROUPED)
def test_a_step_reads_the_host_a_fixed_few_times(audited, name):
    """Once, after the exchange, for the status every rank's message carried (and DeMo's
    validity of what arrived, in the same read): this rank's gradients' finiteness travels as
    a device flag. DiLoCo's inner torch optimizer must skip a bad local update, so its steps
    read this rank's finiteness first: a local step once, a sync twice."""
    reads = [r for _, r in audited[(name, 8)]]
    assert max(reads) == READS[name]
    if name == "diloco":
        assert sorted(reads) == [1] * (SYNC_EVERY - 1) + [2]
    if name == "diloco-fused":
        assert sorted(reads) == [0] * (SYNC_EVERY - 1) + [1]


@pytest.mark.parametrize("name", BF16)
def test_bf16_parameters_cost_about_what_float32_ones_do(audited, name):
    """A bf16 model's step: float32's launches plus a few whole-buffer casts, never per tensor."""
    for blocks in (2, 8):
        for (bf16, _), (fp32, _) in zip(audited[(f"{name}-bf16", blocks)], audited[(name, blocks)]):
            assert fp32 <= bf16 <= fp32 + 12


@pytest.mark.parametrize("name", ["dense-adamw", "diloco"])
def test_every_step_within_three_times_torch_adamw_foreach_launches(audited, name):
    adamw = max(n for n, _ in audited[("torch-adamw-foreach", 8)])
    assert max(n for n, _ in audited[(name, 8)]) <= 3 * adamw


def test_the_prefix_writer_writes_what_write_prefix_writes_step_after_step():
    n = 13
    writer, buf, want = PrefixWriter(), torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    present = [True] * n
    for step, flags in ((1, 0), (2, 1), (2**31 + 5, 0), (2**32 + 3, 1), (7, 0)):
        if step == 7:
            present = [i % 3 != 0 for i in range(n)]          # the presence changes: written whole again
        writer.write(buf, step, flags, present)
        write_prefix(want, step, flags, present)
        assert torch.equal(buf, want), step


def test_the_trailer_writer_writes_what_write_trailer_writes_step_after_step():
    n = 5
    writer, buf, want = TrailerWriter(), torch.zeros(1 + 16 + n), torch.zeros(1 + 16 + n)
    present = [True] * n
    for step, bad in ((1, False), (2, True), (17, False), (18, False), (40, True)):
        if step == 18:
            present = [False, True, True, False, True]
        writer.write(buf, step, bad, present)
        write_trailer(want, step, bad, present)
        assert torch.equal(buf, want), step


# ---- SparseLoCo's sync on the grouped layout (issue 46; `thinwire.optim.sparseloco_groups`) -----
# delay 3 with the eager jump: a cycle holds a local step, the sync step (θ_s, the jump) and the
# landing step (every rank's rows read, Δ̄, θ₀, the rejoin). DiLoCo on the same schedule shows
# what the envelope itself costs, so the difference is SparseLoCo's own.
SPARSELOCO_BUILDS = {
    "sparseloco-delayed": lambda ps: thinwire.SparseLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-3, foreach=True),
                                                         sync_every=SYNC_EVERY, topk=8, chunk=16, overlap=True,
                                                         delay=SYNC_EVERY - 1),
    "diloco-delayed": lambda ps: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-3, foreach=True),
                                                 sync_every=SYNC_EVERY, overlap=True, delay=SYNC_EVERY - 1),
    "torch-adamw-foreach": BUILDS["torch-adamw-foreach"],
}
# bf16 parameters: the same schedule; θ and θ₀ through a flat bf16 scratch (`sparseloco_groups.Dtypes`)
SPARSELOCO_BUILDS["sparseloco-delayed-bf16"] = SPARSELOCO_BUILDS["sparseloco-delayed"]
SPARSELOCO_DTYPES = {"sparseloco-delayed-bf16": torch.bfloat16}


def _sparseloco_audit_all(rank: int, world: int) -> dict:
    saved, saved_dtypes = dict(BUILDS), dict(DTYPES)
    BUILDS.update(SPARSELOCO_BUILDS)
    DTYPES.update(SPARSELOCO_DTYPES)
    try:
        return {(name, blocks): _audited_cycle(rank, world, name, blocks) for name in SPARSELOCO_BUILDS
                for blocks in (2, 8)}
    finally:
        BUILDS.clear()
        BUILDS.update(saved)
        DTYPES.clear()
        DTYPES.update(saved_dtypes)


@pytest.fixture(scope="module")
def sparseloco_audited():
    return run_workers(_sparseloco_audit_all, 2)[0]


def test_sparseloco_sync_launches_stay_flat_and_it_reads_the_host_at_most_once_of_its_own(sparseloco_audited):
    """From 28 to 100 tensors every step launches the same (within 10 %); no host read beyond
    what DiLoCo's envelope makes on the same schedule (the landing's check of what arrived is
    a device flag read with the envelope's, `SparseTopKSync.arrival`). At 8 blocks the sync
    step stays under 16x torch AdamW's launches (it was about 700x before the grouped
    layout; the issue's goal of 3x is not met: see docs/design.md)."""
    two, eight = sparseloco_audited[("sparseloco-delayed", 2)], sparseloco_audited[("sparseloco-delayed", 8)]
    for (a, _), (b, _) in zip(two, eight):
        assert b <= 1.1 * a, (a, b)
    envelope = sparseloco_audited[("diloco-delayed", 8)]
    assert all(r <= e for (_, r), (_, e) in zip(eight, envelope)), (eight, envelope)
    adamw = max(n for n, _ in sparseloco_audited[("torch-adamw-foreach", 8)])
    assert max(n for n, _ in eight) <= 16 * adamw


def test_sparseloco_bf16_sync_launches_as_float32_does_plus_a_few(sparseloco_audited):
    """bf16 parameters join the grouped sync: every step's launches within a few of float32's
    (Δ, θ₀, θ_s and the rejoin through one bf16 scratch: whole-buffer casts and same-dtype
    `_foreach_*` lists; 5 more at the sync and at the landing), the same from 28 to 100
    tensors, and the same host reads (they fell back to the per-tensor path before: at
    world 1, 2,182 / 7,769 launches at 2 / 8 blocks' sync step)."""
    for blocks in (2, 8):
        ours = sparseloco_audited[("sparseloco-delayed-bf16", blocks)]
        fp32 = sparseloco_audited[("sparseloco-delayed", blocks)]
        assert [r for _, r in ours] == [r for _, r in fp32], (blocks, ours, fp32)
        assert all(a <= b + 8 for (a, _), (b, _) in zip(ours, fp32)), (blocks, ours, fp32)
    two, eight = sparseloco_audited[("sparseloco-delayed-bf16", 2)], sparseloco_audited[("sparseloco-delayed-bf16", 8)]
    assert [n for n, _ in two] == [n for n, _ in eight], (two, eight)


def test_the_finiteness_flag_of_mixed_dtypes_is_one_check_per_dtype_and_exact():
    """`nonfinite_flag` over bf16 and float32 gradients: a fixed number of launches however many
    tensors (one multi-tensor check per dtype: torch loops over a mixed list), True for a NaN or
    an inf in either dtype, False for finite values at the edge of bf16's range, and every
    gradient left bit for bit as it was."""
    from thinwire.optim.protocol import nonfinite_flag

    def grads(n):
        edge = torch.tensor([3.4e38, -3.4e38, -0.0, 1e-45])      # float32's largest, a signed zero, a subnormal
        return [torch.full((3,), 3e38, dtype=torch.bfloat16) for _ in range(n)] + [edge.clone() for _ in range(n)]

    counts = []
    nonfinite_flag(grads(1))                                    # makes its constant 1.0 once, as a first step does
    for n in (2, 8):
        tensors, audit = grads(n), StepAudit()
        before = [t.clone() for t in tensors]
        with audit:
            flag = nonfinite_flag(tensors)
        counts.append(audit.launches)
        assert not flag.item()
        for t, b in zip(tensors, before):
            assert torch.equal(t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))
    assert counts[0] == counts[1]
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in (0, -1):
            gs = grads(2)
            gs[i][1] = bad
            assert nonfinite_flag(gs).item()
