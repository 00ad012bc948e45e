"""SparseLoCo with values='8bit' (Templar's 256-level statistical quantizer, one set of levels per
tensor): the payload size (what the harness counts), a round trip against a brute-force
reference (top-k of each chunk by sorting, the kept values through tests/wire/test_eightbit.py's
plain-Python quantizer as one row), and the batched paths bit for bit with `SparseLoCoTopK`
tensor by tensor: `FlatSparseLoCo`, `GroupedSparseLoCo` (bytes, decoded values, every rank's
row read back) and the optimizer's grouped sync against its per-tensor path."""

import math

import pytest
import torch

import thinwire
from tests.compress.test_sparseloco_flat import SHAPE_SETS as FLAT_SETS, _encode as _flat_encode, _per_tensor, _rows
from tests.compress.test_sparseloco_grouped import SHAPE_SETS, _x, encode_as_per_tensor
from tests.optim.test_sparseloco_groups import SHAPES, _run, _same
from tests.wire.test_eightbit import reference_row
from thinwire.compress import ChunkPlan, SparseLoCoTopK
from thinwire.compress.sparseloco_flat import FlatSparseLoCo
from thinwire.compress.sparseloco_grouped import GroupedSparseLoCo
from thinwire.compress.sparseloco_topk import SPARSE_VALUES
from thinwire.wire import checks


def test_payload_size_is_indices_then_1024_level_bytes_then_a_byte_per_value():
    comp = SparseLoCoTopK(32, 16, values="8bit")
    for shape, (chunks, elems, k) in {(37, 24): (6, 192, 24), (37,): (3, 16, 2), (10, 37): (3, 160, 20)}.items():
        width = math.ceil(math.log2(elems))
        assert comp.payload_nbytes(shape) == math.ceil(chunks * k * width / 8) + 1024 + chunks * k
    assert "8bit" in SPARSE_VALUES and comp.codec.name == "8bit" and (comp.codec.levels, comp.codec.bits) == (256, 8)


@pytest.mark.parametrize("indices", ["packed", "elias-fano"])
def test_round_trip_matches_a_brute_force_reference(indices):
    x = torch.randn(80, 50, generator=torch.Generator().manual_seed(3))
    comp = SparseLoCoTopK(topk=16, chunk=8, values="8bit", indices=indices)
    buf = torch.empty(comp.payload_nbytes(x.shape), dtype=torch.uint8)
    comp.encode(x, buf)
    plan, k = ChunkPlan.for_shape(x.shape, 8), comp.k(x.shape)
    coeffs = comp.coefficients(x)                                    # [chunks, h·w], chunk-major
    kept = torch.sort(coeffs.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    if indices == "elias-fano":
        kept = kept.sort(dim=1).values                               # its values travel in index order
    values = coeffs.gather(1, kept)
    codes, levels = reference_row(values.view(-1).tolist())          # one row: the whole tensor
    sent_codes = buf[-values.numel():].tolist()                      # the codes end the payload
    # in index order: ascending for Elias-Fano, top-k's own order for packed
    assert sent_codes == codes if indices == "elias-fano" else sorted(sent_codes) == sorted(codes)
    image = torch.zeros_like(coeffs).scatter_(1, kept, torch.tensor([levels[q] for q in codes]).view_as(values))
    (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
    # [gr·gc, h·w] -> [gr, gc, h, w] -> [gr, h, gc, w] -> [R, C], cropped
    want = image.view(gr, gc, h, w).permute(0, 2, 1, 3).reshape(gr * h, gc * w)[: x.shape[0], : x.shape[1]]
    assert torch.equal(comp.decode(buf, x.shape), want)


@pytest.mark.parametrize("staged", [False, True], ids=["one-by-one", "staged"])
@pytest.mark.parametrize("name", FLAT_SETS)
def test_flat_bytes_and_decoded_values_are_the_per_tensor_ones(name, staged):
    shapes = FLAT_SETS[name]
    comp = SparseLoCoTopK(topk=32, chunk=16, values="8bit")
    flat = FlatSparseLoCo(comp, shapes, "cpu")
    assert flat.groups                                               # 8bit tensors are batched
    x, _ = _rows(shapes, 2)
    payload, sent = _flat_encode(flat, x, staged)
    assert torch.equal(payload, _per_tensor(comp, flat, x))
    rows = flat.decode([payload])
    for i, (shape, part) in enumerate(zip(flat.shapes, flat.payloads)):
        expected = comp.decode(part.of(payload), shape)
        positions, values = sent[i].positions, sent[i].values
        decoded = values.view(shape) if positions is None else torch.zeros(shape).view(-1).index_put_((positions,), values)
        assert torch.equal(decoded.view(shape), expected)
        if i in flat.place:                                          # a peer's read of the row
            assert torch.equal(rows[0][i][0], positions) and torch.equal(rows[0][i][1], values)


@pytest.mark.parametrize("indices", ["packed", "elias-fano"])
@pytest.mark.parametrize("name", SHAPE_SETS)
def test_grouped_bytes_decoded_values_and_reads_are_the_per_tensor_ones(name, indices):
    shapes = SHAPE_SETS[name]
    comp = SparseLoCoTopK(topk=32, chunk=16, values="8bit", indices=indices)
    g = GroupedSparseLoCo(comp, shapes, "cpu")
    assert sorted(g.tensors) == list(range(len(shapes))) and g.level_bytes == 1024   # every tensor joins
    sent = []
    for seed in (0, 1, 2):                                           # buffers reused: later syncs
        sent.append(encode_as_per_tensor(g, comp, _x(shapes, seed), seed))
    read_positions, read_values, flags = g.read(torch.stack([m for m, _, _ in sent]))
    for r, (_, p, v) in enumerate(sent):
        assert torch.equal(read_positions[r], p) and torch.equal(read_values[r], v)
    assert not bool(checks.any_of(flags))


@pytest.mark.parametrize("kw", [dict(), dict(overlap=True, delay=3), dict(aggregate="senders")], ids=str)
def test_the_grouped_sync_follows_the_per_tensor_path_bit_for_bit(kw):
    ours, opt, history = _run(True, values="8bit", **kw)
    assert opt.sync._grouped is not None and opt.sync._grouped.tensors                  # the 8bit tensors joined
    ref, _, ref_history = _run(False, values="8bit", **kw)
    _same((history, ours), (ref_history, ref))


def test_the_message_counts_1024_level_bytes_and_a_byte_per_kept_value_per_tensor():
    """Bytes per sync as the harness counts them (the all-gathered message): the envelope's
    prefix, then per tensor its packed indices, 256 float32 levels and C·k one-byte codes.
    (On these small tensors that is more than fp32's 4 bytes a value: the levels dominate
    below about 340 kept values a tensor.)"""
    _, opt, _ = _run(True, steps=3, values="8bit")
    comp = SparseLoCoTopK(32, 16)
    want = 8 + math.ceil(len(SHAPES) / 8)
    for shape in SHAPES:
        plan, k = comp.plan(shape), comp.k(shape)
        kept = plan.num_chunks * k
        want += math.ceil(kept * math.ceil(math.log2(plan.chunk_elems)) / 8) + 4 * 256 + kept
    assert opt.sync.message.buffer.numel() == want
