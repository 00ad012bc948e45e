"""DeMo's grouped hot path (`thinwire.optim.demo_groups`) against its per-tensor path
(`opt.grouped = False`, the reference the groups must follow): the same parameters and
momenta bit for bit, the same messages byte for byte, state_dict as per-parameter tensors."""

import copy

import pytest
import torch

import thinwire
from thinwire.audit import StepAudit

# chunk 64: groups of chunk shape (64, 64) (bands of 64 and 192 columns) and (1, 64) (both vectors: one-row chunks
# of any width lie end to end); (97, 64) pads its rows to 128 ((100, 64) takes chunks of 50 rows); (37, 24) and (37,) are
# chunks of their own; (10, 37) pads its columns (chunk 16) and stays on the per-tensor path. The vectors have 12
# and 16 chunk rows: MKL's sgemm computes a row alike in calls of any height from 12 rows on (below, the last
# rows % 4 of a call take other kernels: `test_one_row_chunks_of_any_width_share_a_group`)
SHAPES = [(128, 64), (768,), (1024,), (64, 192), (256, 64), (100, 64), (97, 64), (37, 24), (37,), (64, 64)]
SETTINGS = [{}, dict(values="int8"), dict(values="sign"), dict(values="fp32", transform="identity"),
            dict(base="sgd"), dict(aggregate="senders"), dict(momentum_form="reference", base="sgd"),
            dict(overlap=True, lookahead="momentum"), dict(overlap=True, lookahead="message"),
            dict(chunk=16, topk=5)]


def _run(grouped: bool, steps: int = 6, shapes=SHAPES, dtypes=(torch.float32,), device="cpu", **kw):
    """`steps` steps of DeMo on `shapes`, parameter i of dtypes[i % len(dtypes)]."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtypes[i % len(dtypes)]))
              for i, s in enumerate(shapes)]
    opt = thinwire.DeMo(params, **{"lr": 0.01, "topk": 8, "chunk": 64, "weight_decay": 0.1, **kw})
    opt.grouped = grouped
    grads = torch.Generator().manual_seed(1)
    messages = []
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (t == 2 and i == 1) else torch.randn(p.shape, generator=grads).to(device, p.dtype)
        opt.step()
        messages.append(opt._messages[(t + 1) % 2].buffer.clone())
    if kw.get("overlap"):
        opt.flush()
    return params, opt, messages


@pytest.mark.parametrize("kw", SETTINGS, ids=str)
def test_groups_follow_the_per_tensor_path_bit_for_bit(kw):
    ours, opt, sent = _run(True, **kw)
    ref, ref_opt, ref_sent = _run(False, **kw)
    assert opt._groups[1].groups and not ref_opt._groups[1].groups
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum"], ref_opt.state[q]["momentum"])
    for a, b in zip(sent, ref_sent):
        assert torch.equal(a, b)                       # the wire format is the per-tensor one


LOW_SETTINGS = [{}, dict(values="int8"), dict(base="sgd"), dict(momentum_form="reference", base="sgd"),
                dict(overlap=True, lookahead="momentum"), dict(nonfinite="skip")]


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float16,), (torch.bfloat16, torch.float32)],
                         ids=["bf16", "fp16", "bf16+fp32"])
@pytest.mark.parametrize("kw", LOW_SETTINGS, ids=str)
def test_low_precision_groups_round_where_the_per_tensor_path_rounds(kw, dtypes):
    """bf16/fp16 parameters group too (one dtype per group), with float32 momentum, bit for bit
    as the per-tensor path (which widens g exactly and rounds φ(Δ) to θ's dtype)."""
    ours, opt, sent = _run(True, dtypes=dtypes, **kw)
    ref, ref_opt, ref_sent = _run(False, dtypes=dtypes, **kw)
    groups = opt._groups[1].groups
    assert {g.dtype for g in groups} == set(dtypes) and not ref_opt._groups[1].groups
    for p, q in zip(ours, ref):
        assert p.dtype == q.dtype and torch.equal(p, q)
        assert opt.state[p]["momentum"].dtype == torch.float32
        assert torch.equal(opt.state[p]["momentum"], ref_opt.state[q]["momentum"])
    for a, b in zip(sent, ref_sent):
        assert torch.equal(a, b)


if torch.cuda.is_available():                                     # defined only where it can run
    CUDA_CASES = ([((torch.float32,), {}), ((torch.float32,), dict(values="fp32", transform="identity"))]
                  + [(d, kw) for d in [(torch.bfloat16,), (torch.bfloat16, torch.float32)] for kw in LOW_SETTINGS])

    @pytest.mark.parametrize("dtypes, kw", CUDA_CASES, ids=str)
    def test_cuda_groups_follow_the_per_tensor_path_to_the_gemms_rounding(dtypes, kw):
        """On CUDA, cuBLAS picks its GEMM kernel by the problem's shape, and a group's stacked
        transform is another shape than a tensor's own. Seen on an H200 (6 steps): with the DCT
        the momenta differed from the per-tensor path's by at most 6e-7 of their size in every
        setting here, float32 and bf16 alike; the parameters stayed bit for bit, and so did the
        messages except int8 values, whose codes follow the momenta (30-36 bytes of ~20 KB);
        with the identity transform (no GEMM) everything stayed bit for bit. fp16 parameters
        are not here: on the H200 they differed by up to 3 fp16 ulps in ~9 % of elements with
        equal messages, a rounding of the landing not yet found (CPU's test holds fp16 bit for
        bit)."""
        ours, opt, sent = _run(True, dtypes=dtypes, device="cuda", **kw)
        ref, ref_opt, ref_sent = _run(False, dtypes=dtypes, device="cuda", **kw)
        exact = kw.get("transform") == "identity"
        for p, q in zip(ours, ref):
            assert torch.equal(p, q)
            m, r = opt.state[p]["momentum"], ref_opt.state[q]["momentum"]
            if exact:
                assert torch.equal(m, r)
            else:
                torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-7)
        for a, b in zip(sent, ref_sent):
            if kw.get("values") == "int8":
                assert int((a != b).sum()) <= a.numel() // 100    # codes at a rounding's boundary
            else:
                assert torch.equal(a, b)


def test_one_row_chunks_of_any_width_share_a_group():
    """Vectors of 64, 192 and 768 (chunks 1 x 64) are one group of 1 + 3 + 12 rows of 64, each
    vector's chunks where its own image has them; with the identity transform (no GEMM) the
    group is the per-tensor path bit for bit. With the DCT the group's one GEMM computes a
    vector of under 12 chunk rows with other kernels than its own small GEMM does on CPU
    (MKL: the last rows % 4 of a call under 12 rows), so there the two agree to rounding."""
    shapes, kw = [(64,), (192,), (768,)], dict(transform="identity", values="fp32", base="sgd")
    ours, opt, sent = _run(True, shapes=shapes, **kw)
    ref, _, ref_sent = _run(False, shapes=shapes, **kw)
    [group] = opt._groups[1].groups
    assert group.members == [0, 1, 2] and group.momentum.numel() == 16 * 64
    assert [(p.padded_rows, p.padded_cols) for p in group.chunks.bands.plans] == [(16, 64)]
    assert [tuple(v.shape) for v in group.views] == [(1, 64), (1, 192), (1, 768)]
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)
    for a, b in zip(sent, ref_sent):
        assert torch.equal(a, b)


def test_matrices_of_one_chunk_shape_share_a_group_band_by_band():
    """SHAPES' 64 x 64 chunks: one group whose members of 64 columns form one band and the
    (64, 192) another (members ordered by band), each state a view of the one flat momentum;
    `test_groups_follow_the_per_tensor_path_bit_for_bit` holds its arithmetic."""
    params, opt, _ = _run(True, steps=1)
    group = opt._groups[1].groups[0]
    shapes = [tuple(params[i].shape) for i in group.members]
    assert shapes == [(128, 64), (256, 64), (97, 64), (64, 64), (64, 192)]
    assert [(p.padded_rows, p.padded_cols) for p in group.chunks.bands.plans] == [(128 + 256 + 128 + 64, 64), (64, 192)]
    for i, view in zip(group.members, group.views):
        assert opt.state[params[i]]["momentum"].data_ptr() == view.data_ptr()


def test_a_padded_column_shape_stays_on_the_per_tensor_path():
    _, opt, _ = _run(True, steps=1, shapes=[(10, 37), (32, 16)], chunk=16, topk=8)
    groups = opt._groups[1]
    assert groups.rest == [0] and [g.members for g in groups.groups] == [[1]]


def test_ties_between_equal_magnitudes_resolve_as_on_the_per_tensor_path():
    """Every coefficient ±1 (identity transform): top-k chooses among ties; the group's one
    call over all chunks must choose as the per-tensor calls did (on CPU it does: each row is
    selected on its own; a GPU's top-k may pick another algorithm for more rows)."""
    results = []
    for grouped in (True, False):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in [(64, 64), (128, 64)]]
        opt = thinwire.DeMo(params, lr=0.01, topk=8, chunk=64, transform="identity", values="fp32", base="sgd")
        opt.grouped = grouped
        for p in params:
            p.grad = torch.ones(p.shape)
        opt.step()
        results.append(([p.detach().clone() for p in params], opt._messages[1].buffer.clone()))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert torch.equal(results[0][1], results[1][1])


def test_state_is_per_parameter_views_and_a_loaded_state_resumes_in_lockstep():
    params, opt, _ = _run(True, steps=3)
    group = opt._groups[1].groups[0]
    m = opt.state[params[0]]["momentum"]
    assert m.shape == (128, 64) and m.untyped_storage().data_ptr() == group.momentum.untyped_storage().data_ptr()
    saved = copy.deepcopy(opt.state_dict())                # as torch.save / torch.load would
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = thinwire.DeMo(copies, lr=0.01, topk=8, chunk=64, weight_decay=0.1)
    fresh.load_state_dict(saved)
    grads = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q in zip(params, copies):
            p.grad = torch.randn(p.shape, generator=grads)
            q.grad = p.grad.clone()
        opt.step()
        fresh.step()
    for p, q in zip(params, copies):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum"], fresh.state[q]["momentum"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_launches_do_not_grow_with_the_parameter_count(dtype):
    """One steady-state step of the same geometries, 3 and 12 tensors of each: the same launches."""
    counts = []
    for copies in (3, 12):
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype))
                  for _ in range(copies) for s in [(64, 64), (64,), (64, 192)]]
        opt = thinwire.DeMo(params, lr=0.01, topk=8, chunk=64)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, dtype=dtype)
            audit = StepAudit()
            with audit:
                opt.step()
        counts.append(audit.launches)
    assert counts[0] == counts[1]


def test_a_step_not_skipped_leaves_the_momentum_exactly_as_it_was():
    """`put_back` with skip False adds −0.0 and must not re-project the padding either: the
    projection T(P·T⁻¹(·)) does not give back its input bit for bit (here: coefficients that
    are not those of a zero-padded tensor, so the projection moves them)."""
    from thinwire.optim import demo_groups
    _, opt, _ = _run(True, steps=2, shapes=[(97, 64), (64, 64)])      # 97 rows pad to 128
    slots = opt._slots(opt.layout())
    g = next(g for g in opt._groups[1].groups if g.padded)
    g.momentum.copy_(torch.randn(g.momentum.shape, generator=torch.Generator().manual_seed(3)))
    before = g.momentum.clone()
    positions = torch.zeros(1, 8, dtype=torch.int64)
    values = torch.ones(1, 8)
    demo_groups.put_back(g, slots, 3, positions, values, torch.tensor(False))
    assert torch.equal(g.momentum, before)
    demo_groups.put_back(g, slots, 3, positions, values, torch.tensor(True))
    view, plan = g.padded[0]                                          # the padded member's image in the momentum
    strip = view[plan.padded_rows - plan.chunk_rows:]
    at = strip.data_ptr() // strip.element_size() - g.momentum.data_ptr() // g.momentum.element_size()
    assert not torch.equal(strip.reshape(-1), before[at: at + strip.numel()])   # projected where it is skipped
