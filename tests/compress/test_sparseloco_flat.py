"""FlatSparseLoCo (thinwire.compress.sparseloco_flat) against SparseLoCoTopK tensor by tensor:
the same bytes, the same decoded values, the same mean of several ranks' rows, the same
errors on malformed rows; over groups of tensors whose shares end on a byte and groups whose
do not, tensors on their own (padded, 'dct', 'int8') and a mix of them."""

import pytest
import torch

from thinwire.compress import Payload, SparseLoCoTopK
from thinwire.compress.sparseloco_flat import FlatSparseLoCo

# chunk 16, topk 32: matrices of 16 x 16 chunks (k 32, 8-bit indices), vectors of 1 x 16
# chunks (k 2, 4-bit indices), (40,) of 1 x 10 chunks (k 1), (37, 24) padded to 48 rows.
ALIGNED = [(64, 32), (96,), (32, 96), (64,), (40,)]
UNALIGNED = [(64, 32), (48,), (96,), (32, 96)]      # (48,): 6 kept values, 6 codes: not whole bytes
MIXED = [(64, 32), (37, 24), (96,), (40,), (48,)]
SHAPE_SETS = {"aligned": ALIGNED, "unaligned": UNALIGNED, "mixed": MIXED}
SETTINGS = [dict(), dict(transform="dct"), dict(values="int8")]


def _rows(shapes, world: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(torch.Size(s).numel() for s in shapes)
    return [torch.randn(n, generator=gen) * torch.rand(1, generator=gen) for _ in range(world)]


def _per_tensor(comp: SparseLoCoTopK, flat: FlatSparseLoCo, x: torch.Tensor) -> torch.Tensor:
    """Every tensor's payload from SparseLoCoTopK alone, end to end."""
    parts = []
    for shape, span in zip(flat.shapes, flat.elements):
        out = torch.empty(comp.payload_nbytes(shape), dtype=torch.uint8)
        comp.encode(span.of(x).view(shape).clone(), out)
        parts.append(out)
    return torch.cat(parts)


def _encode(flat: FlatSparseLoCo, x: torch.Tensor):
    payload = torch.empty(flat.payloads[-1].stop, dtype=torch.uint8)
    return payload, flat.encode(x, payload)


@pytest.mark.parametrize("settings", SETTINGS, ids=["2bit", "dct", "int8"])
@pytest.mark.parametrize("name", SHAPE_SETS)
def test_bytes_and_decoded_values_are_the_per_tensor_ones(name, settings):
    shapes = SHAPE_SETS[name]
    comp = SparseLoCoTopK(topk=32, chunk=16, **settings)
    flat = FlatSparseLoCo(comp, shapes, "cpu")
    x = _rows(shapes, 1)[0]
    payload, pieces = _encode(flat, x)
    assert torch.equal(payload, _per_tensor(comp, flat, x))
    decoded = torch.zeros_like(x)                                  # Δ̂ from the pieces, flat
    for piece in pieces:
        if piece.positions is None:
            flat.elements[piece.members[0]].of(decoded).copy_(piece.values)
        else:
            decoded.index_put_((piece.positions,), piece.values)
    for shape, span, part in zip(flat.shapes, flat.elements, flat.payloads):
        expected = comp.decode(part.of(payload), shape)
        assert torch.equal(span.of(decoded).view(shape), expected)
    assert sorted(i for piece in pieces for i in piece.members) == list(range(len(shapes)))


def test_groups_are_by_chunk_geometry_and_padding_or_transform_keeps_a_tensor_alone():
    flat = FlatSparseLoCo(SparseLoCoTopK(topk=32, chunk=16), MIXED, "cpu")
    assert sorted(g.members for g in flat.groups) == [(0,), (2, 4), (3,)]
    assert flat.alone == [1]                                        # (37, 24) pads its rows
    assert FlatSparseLoCo(SparseLoCoTopK(topk=32, chunk=16, transform="dct"), MIXED, "cpu").groups == []


@pytest.mark.parametrize("mode", ["mean", "senders"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["2bit", "dct", "int8"])
def test_mean_of_three_rows_is_the_per_tensor_aggregate(settings, mode):
    comp = SparseLoCoTopK(topk=32, chunk=16, **settings)
    flat = FlatSparseLoCo(comp, MIXED, "cpu")
    encoded = [_encode(flat, x) for x in _rows(MIXED, 3, seed=1)]
    rows = [payload for payload, _ in encoded]
    out = torch.empty(flat.numel)
    expected = []
    for shape, part in zip(flat.shapes, flat.payloads):
        reads = [comp.read(Payload.from_buffer(part.of(row), comp.payload_spec(shape)), shape) for row in rows]
        expected.append(comp.aggregate(reads, shape, mode=mode).reshape(-1).clone())
    assert torch.equal(flat.mean(rows, 0, mode, out), torch.cat(expected))
    assert torch.equal(flat.mean(rows, 0, mode, torch.empty(flat.numel), own=(1, encoded[1][1])), torch.cat(expected))


def test_a_malformed_row_is_refused_with_the_per_tensor_errors():
    comp = SparseLoCoTopK(topk=32, chunk=16)
    flat = FlatSparseLoCo(comp, ALIGNED, "cpu")
    payload, _ = _encode(flat, _rows(ALIGNED, 1)[0])
    bad_index = payload.clone()
    bad_index[flat.payloads[4].start] = 0xFF                       # (40,): indices of 4 bits, chunks of 10
    with pytest.raises(ValueError, match="index 15 out of range for a chunk of 10"):
        flat.mean([payload, bad_index], 0, "mean", torch.empty(flat.numel))
    bad_level = payload.clone()
    levels = flat.payloads[0].start + comp.payload_spec(ALIGNED[0])[0][1]
    bad_level[levels: levels + 16] = torch.tensor([float("nan")] * 4).view(torch.uint8)
    with pytest.raises(ValueError, match="non-finite values"):
        flat.mean([bad_level, payload], 0, "mean", torch.empty(flat.numel))
