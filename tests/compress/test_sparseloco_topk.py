"""SparseLoCo's compressor (thinwire.compress.SparseLoCoTopK): k at a fixed density per chunk,
one set of 2-bit levels per tensor, the documented sizes, and a round trip against a
brute-force reference (top-k of each chunk by sorting, the values through the '2bit' codec
as one row)."""

import math

import pytest
import torch

from thinwire.compress import ChunkPlan, Payload, SparseLoCoTopK
from thinwire.wire import get_codec


@pytest.mark.parametrize("shape, topk, chunk, k", [
    ((64, 64), 128, 64, 128), ((32, 64), 128, 64, 64), ((64,), 128, 64, 2), ((256, 64), 128, 64, 128),
    ((10,), 64, 16, 2),        # 10 · 64 / 256 = 2.5: half to even
    ((30,), 64, 16, 4),        # 30 -> 2 chunks of 15: 15 · 64 / 256 = 3.75 -> 4
    ((1,), 1, 16, 1), ((37, 24), 256, 16, 192)])
def test_k_keeps_the_density_on_every_chunk(shape, topk, chunk, k):
    assert SparseLoCoTopK(topk, chunk).k(shape) == k


@pytest.mark.parametrize("values, value_bytes", [("2bit", lambda c, k: 16 + math.ceil(c * k / 4)),
                                                 ("int8", lambda c, k: 4 * c + c * k),
                                                 ("bf16", lambda c, k: 2 * c * k), ("fp32", lambda c, k: 4 * c * k)])
def test_payload_size_is_the_documented_formula(values, value_bytes):
    comp = SparseLoCoTopK(32, 16, values=values)
    for shape, (chunks, elems, k) in {(37, 24): (6, 192, 24), (37,): (3, 16, 2), (10, 37): (3, 160, 20)}.items():
        width = math.ceil(math.log2(elems))
        assert comp.payload_nbytes(shape) == math.ceil(chunks * k * width / 8) + value_bytes(chunks, k)


def test_elias_fano_payload_size_is_the_documented_formula():
    comp = SparseLoCoTopK(32, 16, indices="elias-fano")
    for shape, (chunks, elems, k) in {(37, 24): (6, 192, 24), (37,): (3, 16, 2), (10, 37): (3, 160, 20)}.items():
        low = math.floor(math.log2(elems / k))
        bitmap = k + (elems - 1) // 2 ** low + 1
        indices = math.ceil(chunks * k * low / 8) + math.ceil(chunks * bitmap / 8)
        assert comp.payload_nbytes(shape) == indices + 16 + math.ceil(chunks * k / 4)


@pytest.mark.parametrize("transform", ["identity", "dct"])
@pytest.mark.parametrize("indices", ["packed", "elias-fano"])
def test_round_trip_matches_a_brute_force_reference(transform, indices):
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(3))
    comp = SparseLoCoTopK(topk=16, chunk=8, transform=transform, indices=indices)
    buf = torch.empty(comp.payload_nbytes(x.shape), dtype=torch.uint8)
    comp.encode(x, buf)
    y = comp.decode(buf, x.shape)
    plan = ChunkPlan.for_shape(x.shape, 8)
    coeffs = comp.coefficients(x)                                    # [chunks, h·w], chunk-major
    k = comp.k(x.shape)
    kept = torch.sort(coeffs.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    if indices == "elias-fano":
        kept = kept.sort(dim=1).values                               # its values travel in index order
    values = coeffs.gather(1, kept)
    levels = get_codec("2bit").roundtrip(values.reshape(1, -1)).view_as(values)   # one row: the tensor
    image = torch.zeros_like(coeffs).scatter_(1, kept, levels)
    (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
    image = image.view(gr, gc, h, w).permute(0, 2, 1, 3).reshape(plan.padded_rows, plan.padded_cols)
    expected = plan.crop(comp.transform.inverse_image(image.contiguous(), plan))
    if transform == "identity":
        assert torch.equal(y, expected)
        assert int((y != 0).sum()) == plan.num_chunks * k
    else:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform, shape, indices", [
    ("identity", (40, 24), "packed"), ("identity", (37, 24), "packed"),       # unpadded, padded
    ("identity", (37,), "packed"), ("dct", (37, 24), "packed"), ("identity", (37, 24), "elias-fano")])
def test_encode_sent_is_what_a_receiver_decodes(transform, shape, indices):
    """The sender's own view of its message (for e' = e − Δ̂) equals the receiver's decode of
    the bytes, and the bytes equal encode()'s; sparse (positions) for 'identity'."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    comp = SparseLoCoTopK(topk=16, chunk=8, transform=transform, indices=indices)
    plain, sent_bytes = (torch.empty(comp.payload_nbytes(shape), dtype=torch.uint8) for _ in range(2))
    comp.encode(x, plain)
    positions, values, read = comp.encode_sent(x, sent_bytes)
    assert torch.equal(sent_bytes, plain)
    received = comp.decode(sent_bytes, shape)
    if transform == "dct":
        assert positions is None and read is None and torch.equal(values, received)
        return
    indices, decoded = comp.read(Payload.from_buffer(sent_bytes, comp.payload_spec(shape)), shape)
    assert torch.equal(read[0], indices) and torch.equal(read[1], decoded)
    assert len(set(positions.tolist())) == positions.numel() <= comp.plan(shape).num_chunks * comp.k(shape)
    dense = torch.zeros(x.numel()).index_put_((positions,), values).view(shape)
    assert torch.equal(dense, received)


@pytest.mark.parametrize("kwargs, name", [({"topk": 65}, "topk"), ({"transform": "random"}, "transform"),
                                          ({"values": "sign"}, "values"), ({"chunk": 0}, "chunk"),
                                          ({"indices": "gamma"}, "indices")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SparseLoCoTopK(**{"topk": 8, "chunk": 8, **kwargs})
