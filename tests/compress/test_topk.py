"""ChunkedTopK against direct computations: kept coefficients, decode, aggregation, validation."""

import math

import pytest
import torch

from thinwire.compress import ChunkedTopK, Payload
from thinwire.ops import dct_matrix


def roundtrip(comp, x, step=0):
    """decode(encode(x)) through the compressor protocol (flat uint8 payload)."""
    out = torch.empty(comp.payload_nbytes(x.shape), dtype=torch.uint8)
    comp.encode(x, out, step)
    return comp.decode(out, x.shape, step)


def payload_of(comp, x, step=0) -> Payload:
    out = torch.empty(comp.payload_nbytes(x.shape), dtype=torch.uint8)
    comp.encode(x, out, step)
    return Payload.from_buffer(out, comp.payload_spec(x.shape))


def naive_dct2(block: torch.Tensor) -> torch.Tensor:
    """Orthonormal 2-D DCT-II by the defining double sum, in float64."""
    h, w = block.shape
    out = torch.zeros(h, w, dtype=torch.float64)
    for u in range(h):
        for v in range(w):
            cu = math.sqrt(1 / h) if u == 0 else math.sqrt(2 / h)
            cv = math.sqrt(1 / w) if v == 0 else math.sqrt(2 / w)
            total = 0.0
            for i in range(h):
                for j in range(w):
                    total += block[i, j].item() * math.cos(math.pi * (2 * i + 1) * u / (2 * h)) * \
                        math.cos(math.pi * (2 * j + 1) * v / (2 * w))
            out[u, v] = cu * cv * total
    return out


def test_dct_matrix_is_the_orthonormal_dct():
    d = dct_matrix(8, torch.float64)
    assert torch.allclose(d @ d.T, torch.eye(8, dtype=torch.float64), atol=1e-12)
    block = torch.randn(4, 6, dtype=torch.float64)
    assert torch.allclose(dct_matrix(4, torch.float64) @ block @ dct_matrix(6, torch.float64).T,
                          naive_dct2(block), atol=1e-10)


def test_coefficients_of_a_chunk_are_its_dct():
    comp = ChunkedTopK(topk=4, chunk=4, transform="dct", values="fp32")
    x = torch.randn(8, 12)
    coeffs = comp.coefficients(x).view(2, 3, 4, 4)
    assert torch.allclose(coeffs[1, 2].double(), naive_dct2(x[4:8, 8:12].double()), atol=1e-5)


@pytest.mark.parametrize("transform", ["dct", "random", "identity"])
def test_all_coefficients_kept_reconstructs_exactly(transform):
    comp = ChunkedTopK(topk=64, chunk=8, transform=transform, values="fp32", seed=3)
    x = torch.randn(13, 20)
    assert torch.allclose(roundtrip(comp, x, step=5), x, atol=1e-5)


def test_identity_keeps_the_k_largest_per_chunk():
    comp = ChunkedTopK(topk=3, chunk=4, transform="identity", values="fp32")
    x = torch.randn(4, 8)
    y = roundtrip(comp, x)
    for block in (slice(0, 4), slice(4, 8)):
        xb, yb = x[:, block].reshape(-1), y[:, block].reshape(-1)
        keep = xb.abs().argsort(descending=True)[:3]
        expected = torch.zeros_like(xb)
        expected[keep] = xb[keep]
        assert torch.equal(yb, expected)


@pytest.mark.parametrize("ranks", [1, 3, 4])      # 3 x 5 < 8 + 8: sparse inverse; 4 x 5: dense inverse
def test_aggregate_mean_is_average_of_decodes_and_senders_matches_scatter_mean(ranks):
    comp = ChunkedTopK(topk=5, chunk=8, transform="dct", values="fp32")
    xs = [torch.randn(16, 8) for _ in range(ranks)]
    reads = [comp.read(payload_of(comp, x), (16, 8)) for x in xs]
    mean = comp.aggregate(reads, (16, 8), mode="mean")
    assert torch.allclose(mean, sum(roundtrip(comp, x) for x in xs) / ranks, atol=1e-6)
    # bloc97/DeMo: concatenate all ranks' (index, value) pairs, scatter_reduce(mean) per chunk.
    idx = torch.cat([r[0] for r in reads], dim=-1)
    val = torch.cat([r[1] for r in reads], dim=-1)
    coeffs = torch.zeros(2, 64).scatter_reduce(-1, idx, val, reduce="mean", include_self=False)
    d = dct_matrix(8)
    expected = (d.T @ coeffs.view(2, 8, 8) @ d).reshape(16, 8)
    assert torch.allclose(comp.aggregate(reads, (16, 8), mode="senders"), expected, atol=1e-6)


def test_payload_size_matches_layout():
    comp = ChunkedTopK(topk=32, chunk=64, values="bf16")
    # 128 x 192: 2 x 3 chunks of 64 x 64 = 4096 elements -> 12-bit indices.
    assert comp.payload_spec((128, 192)) == (("indices", 6 * 32 * 12 // 8), ("values", 6 * 32 * 2))
    assert payload_of(comp, torch.randn(128, 192)).nbytes == comp.payload_nbytes((128, 192))


def test_out_of_range_index_and_wrong_length_raise():
    comp = ChunkedTopK(topk=2, chunk=4, transform="identity", values="fp32")
    shape = (3,)  # one chunk of 3 elements: 2-bit indices can encode 3, which is out of range
    buf = payload_of(comp, torch.tensor([1.0, -2.0, 3.0])).parts
    bad = torch.cat([torch.tensor([0xFF], dtype=torch.uint8), buf["values"]])  # indices 3, 3
    with pytest.raises(ValueError, match="out of range"):
        comp.read(Payload.from_buffer(bad, comp.payload_spec(shape)), shape)
    with pytest.raises(ValueError, match="malformed payload"):
        Payload.from_buffer(bad[:-1], comp.payload_spec(shape))


def test_non_finite_values_rejected():
    comp = ChunkedTopK(topk=1, chunk=4, transform="identity", values="fp32")
    payload = payload_of(comp, torch.tensor([0.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="non-finite"):
        comp.read(payload, (3,))


@pytest.mark.parametrize("kwargs, name", [({"topk": 0}, "topk"), ({"chunk": 0}, "chunk"),
                                          ({"transform": "fft"}, "transform"), ({"values": "fp8"}, "values")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ChunkedTopK(**kwargs)
