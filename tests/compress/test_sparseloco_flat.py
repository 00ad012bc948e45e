"""FlatSparseLoCo (thinwire.compress.sparseloco_flat) against SparseLoCoTopK tensor by tensor:
the same bytes, the same decoded values (each tensor's top-k on its own, or every group's
selected at once after staging), the same mean of several ranks' rows, the same errors on
malformed rows; over groups of tensors whose shares end on a byte and groups whose
do not, tensors on their own (padded, 'dct', 'int8') and a mix of them; with the indices
packed or Elias-Fano coded."""

import pytest
import torch

from thinwire.compress import Payload, SparseLoCoTopK
from thinwire.compress.sparseloco_flat import FlatSparseLoCo
from thinwire.wire import packed_nbytes

# chunk 16, topk 32: matrices of 16 x 16 chunks (k 32, 8-bit indices), vectors of 1 x 16
# chunks (k 2, 4-bit indices), (40,) of 1 x 10 chunks (k 1), (37, 24) padded to 48 rows.
ALIGNED = [(64, 32), (96,), (32, 96), (64,), (40,)]
UNALIGNED = [(64, 32), (48,), (96,), (32, 96)]      # (48,): 6 kept values, 6 codes: not whole bytes
MIXED = [(64, 32), (37, 24), (96,), (40,), (48,)]
SHAPE_SETS = {"aligned": ALIGNED, "unaligned": UNALIGNED, "mixed": MIXED}
SETTINGS = [dict(), dict(transform="dct"), dict(values="int8"), dict(indices="elias-fano"),
            dict(values="int8", indices="elias-fano")]
SETTING_IDS = ["2bit", "dct", "int8", "2bit-ef", "int8-ef"]     # 2bit-ef: aligned and unaligned groups in every set


def _rows(shapes, world: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(torch.Size(s).numel() for s in shapes)
    return [torch.randn(n, generator=gen) * torch.rand(1, generator=gen) for _ in range(world)]


def _tensors(flat: FlatSparseLoCo, x: torch.Tensor) -> list[torch.Tensor]:
    return [part.view(shape) for part, shape in zip(x.split([torch.Size(s).numel() for s in flat.shapes]), flat.shapes)]


def _per_tensor(comp: SparseLoCoTopK, flat: FlatSparseLoCo, x: torch.Tensor) -> torch.Tensor:
    """Every tensor's payload from SparseLoCoTopK alone, end to end."""
    parts = []
    for t in _tensors(flat, x):
        out = torch.empty(comp.payload_nbytes(t.shape), dtype=torch.uint8)
        comp.encode(t.clone(), out)
        parts.append(out)
    return torch.cat(parts)


def _encode(flat: FlatSparseLoCo, x: torch.Tensor, staged: bool = False):
    """The sync's order: every tensor encoded, then the groups' bytes written; staged: every
    tensor's magnitudes first and one selection over each group (SparseLoCo's sync)."""
    payload = torch.empty(flat.nbytes, dtype=torch.uint8)
    if staged:
        for i, t in enumerate(_tensors(flat, x)):
            flat.stage(i, t)
        flat.select()
    sent = {i: flat.encode(i, t, payload) for i, t in enumerate(_tensors(flat, x))}
    flat.write(payload)
    return payload, sent


@pytest.mark.parametrize("staged", [False, True], ids=["one-by-one", "staged"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("name", SHAPE_SETS)
def test_bytes_and_decoded_values_are_the_per_tensor_ones(name, settings, staged):
    shapes = SHAPE_SETS[name]
    comp = SparseLoCoTopK(topk=32, chunk=16, **settings)
    flat = FlatSparseLoCo(comp, shapes, "cpu")
    x, later = _rows(shapes, 2)
    payload, sent = _encode(flat, x, staged)
    assert torch.equal(payload, _per_tensor(comp, flat, x))
    # a selection ends with its bytes: the next encode, not staged, selects its own
    assert torch.equal(_encode(flat, later)[0], _per_tensor(comp, flat, later))
    for i, (shape, part) in enumerate(zip(flat.shapes, flat.payloads)):
        expected = comp.decode(part.of(payload), shape)
        positions, values = sent[i].positions, sent[i].values
        decoded = values.view(shape) if positions is None else torch.zeros(shape).view(-1).index_put_((positions,), values)
        assert torch.equal(decoded.view(shape), expected)


def test_groups_are_by_chunk_geometry_and_padding_or_transform_keeps_a_tensor_alone():
    flat = FlatSparseLoCo(SparseLoCoTopK(topk=32, chunk=16), MIXED, "cpu")
    assert sorted(g.members for g in flat.groups) == [[0], [2, 4], [3]]
    assert flat.alone == [1]                                        # (37, 24) pads its rows
    assert FlatSparseLoCo(SparseLoCoTopK(topk=32, chunk=16, transform="dct"), MIXED, "cpu").groups == []


@pytest.mark.parametrize("mode", ["mean", "senders"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_mean_of_three_rows_is_the_per_tensor_aggregate(settings, mode):
    comp = SparseLoCoTopK(topk=32, chunk=16, **settings)
    flat = FlatSparseLoCo(comp, MIXED, "cpu")
    encoded = [_encode(flat, x) for x in _rows(MIXED, 3, seed=1)]
    rows = [payload for payload, _ in encoded]
    expected = []
    for shape, part in zip(flat.shapes, flat.payloads):
        reads = [comp.read(Payload.from_buffer(part.of(row), comp.payload_spec(shape)), shape) for row in rows]
        expected.append(comp.aggregate(reads, shape, mode=mode).clone())
    for own in (None, (1, encoded[1][1])):
        decoded = flat.decode(rows, own)
        for i, shape in enumerate(flat.shapes):
            assert torch.equal(flat.mean(i, decoded, rows, 0, mode, torch.empty(shape)), expected[i])


def test_a_malformed_row_is_refused_with_the_per_tensor_errors():
    comp = SparseLoCoTopK(topk=32, chunk=16)
    flat = FlatSparseLoCo(comp, ALIGNED, "cpu")
    payload, _ = _encode(flat, _rows(ALIGNED, 1)[0])
    bad_index = payload.clone()
    bad_index[flat.payloads[4].start] = 0xFF                       # (40,): indices of 4 bits, chunks of 10
    with pytest.raises(ValueError, match="index 15 out of range for a chunk of 10"):
        flat.decode([payload, bad_index])
    bad_level = payload.clone()
    levels = flat.payloads[0].start + comp.payload_spec(ALIGNED[0])[0][1]
    bad_level[levels: levels + 16] = torch.tensor([float("nan")] * 4).view(torch.uint8)
    with pytest.raises(ValueError, match="non-finite values"):
        flat.decode([bad_level, payload])


def test_a_malformed_elias_fano_row_is_refused_with_the_per_tensor_errors():
    comp = SparseLoCoTopK(topk=32, chunk=16, indices="elias-fano")
    flat = FlatSparseLoCo(comp, ALIGNED, "cpu")
    payload, _ = _encode(flat, _rows(ALIGNED, 1)[0])
    lows = packed_nbytes(comp.plan(ALIGNED[0]).num_chunks * 32, 3)
    bad = payload.clone()
    bad[flat.payloads[0].start + lows] ^= 0x01                      # (64, 32): a bit of the first bitmap flipped
    part = bad[flat.payloads[0].start: flat.payloads[0].stop]
    with pytest.raises(ValueError, match="bitmap holds") as per_tensor:
        comp.read(Payload.from_buffer(part, comp.payload_spec(ALIGNED[0])), ALIGNED[0])
    with pytest.raises(ValueError, match="bitmap holds") as flat_error:
        flat.decode([payload, bad])
    assert str(flat_error.value) == str(per_tensor.value)
