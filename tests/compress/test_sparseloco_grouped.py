"""GroupedSparseLoCo (thinwire.compress.sparseloco_grouped) against SparseLoCoTopK tensor by
tensor: the same bytes for every joined tensor, the same decoded values at the same flat
positions, every rank's row read back with its flags; over shares that end on a byte and
shares that do not, tensors that stay alone (padded, 'dct', 'int8'), packed and Elias-Fano
indices, and several column counts of one chunk shape (stacks of one family)."""

import pytest
import torch

from thinwire.compress import SparseLoCoTopK
from thinwire.compress.sparseloco_grouped import GroupedSparseLoCo
from thinwire.wire import checks

# chunk 16, topk 32 (as test_sparseloco_flat.py): matrices of 16 x 16 chunks, vectors of 1 x 16
ALIGNED = [(64, 32), (96,), (32, 96), (64,), (40,)]
UNALIGNED = [(64, 32), (48,), (96,), (32, 96), (16, 32)]
MIXED = [(64, 32), (37, 24), (96,), (40,), (48,), (32, 32), (64, 32)]
SHAPE_SETS = {"aligned": ALIGNED, "unaligned": UNALIGNED, "mixed": MIXED}
SETTINGS = [dict(), dict(indices="elias-fano"), dict(transform="dct"), dict(values="int8")]
SETTING_IDS = ["2bit", "2bit-ef", "dct", "int8"]


def _x(shapes, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = sum(torch.Size(s).numel() for s in shapes)
    return torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4


def _tensor(g: GroupedSparseLoCo, x: torch.Tensor, i: int) -> torch.Tensor:
    return x[g.offsets[i]: g.offsets[i] + torch.Size(g.shapes[i]).numel()].view(g.shapes[i])


def _encode(g: GroupedSparseLoCo, x: torch.Tensor):
    message = torch.zeros(g.nbytes, dtype=torch.uint8)
    g.select(x, torch.empty_like(x))
    positions, values = g.encode(x, message)
    return message, positions.clone(), values.clone()


def encode_as_per_tensor(g: GroupedSparseLoCo, comp: SparseLoCoTopK, x: torch.Tensor, seed: int):
    """One sync of the group on x, checked: every grouped tensor's bytes, and its decoded
    values, are the per-tensor compressor's. Returns (message, positions, values)."""
    message, positions, values = _encode(g, x)
    # a value kept in a padding is +0.0 at position 0: index_add_ adds nothing for it
    decoded = torch.zeros_like(x).index_add_(0, positions, values)
    for i in g.tensors:
        want = torch.empty(comp.payload_nbytes(g.shapes[i]), dtype=torch.uint8)
        comp.encode(_tensor(g, x, i).clone(), want)
        assert torch.equal(g.payloads[i].of(message), want), (i, seed)
        assert torch.equal(_tensor(g, decoded, i), comp.decode(want, g.shapes[i])), (i, seed)
    return message, positions, values


@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("name", SHAPE_SETS)
def test_bytes_and_decoded_values_are_the_per_tensor_ones(name, settings):
    shapes = SHAPE_SETS[name]
    comp = SparseLoCoTopK(topk=32, chunk=16, **settings)
    g = GroupedSparseLoCo(comp, shapes, "cpu")
    for seed in (0, 1):                                       # buffers reused: a second sync
        encode_as_per_tensor(g, comp, _x(shapes, seed), seed)
        if settings.get("transform") == "dct" or settings.get("values") == "int8":
            assert g.tensors == [] and g.alone == list(range(len(shapes)))


@pytest.mark.parametrize("settings", SETTINGS[:2], ids=SETTING_IDS[:2])
@pytest.mark.parametrize("name", SHAPE_SETS)
def test_every_ranks_row_reads_back_as_its_encode_decoded_it(name, settings):
    shapes = SHAPE_SETS[name]
    g = GroupedSparseLoCo(SparseLoCoTopK(topk=32, chunk=16, **settings), shapes, "cpu")
    sent = [_encode(g, _x(shapes, seed)) for seed in range(3)]
    positions, values, flags = g.read(torch.stack([m for m, _, _ in sent]))
    for r, (_, p, v) in enumerate(sent):
        assert torch.equal(positions[r], p) and torch.equal(values[r], v)
    assert not bool(checks.any_of(flags))


def test_a_non_finite_level_from_a_peer_is_flagged_on_the_device():
    g = GroupedSparseLoCo(SparseLoCoTopK(topk=32, chunk=16), ALIGNED, "cpu")
    message, _, _ = _encode(g, _x(ALIGNED, 0))
    bad = message.clone()
    first = g.tensors[0]
    at = g.payloads[first].start + g.comp.coding(ALIGNED[first]).nbytes(g.comp.plan(ALIGNED[first]).num_chunks)
    bad[at: at + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    _, _, flags = g.read(torch.stack([message, bad]))
    assert bool(checks.any_of(flags))


def test_tensors_of_one_chunk_shape_form_one_family_stacked_by_columns():
    shapes = [(64, 32), (37, 24), (96,), (48,), (16, 64), (32, 32), (32, 16)]
    g = GroupedSparseLoCo(SparseLoCoTopK(topk=32, chunk=16), shapes, "cpu")
    assert g.alone == []
    # 16 x 16 chunks: (32, 16) one chunk wide (chunk-major is row-major: the None stack), then
    # cols 32 (two tensors stacked), cols 64; (37, 24) pads its rows to 48 (16 x 12 chunks): its
    # own image; 1 x 16 chunks: all row-major
    assert [f.members for f in g.families] == [[6, 0, 5, 4], [1], [2, 3]]
    assert [[cols for cols, *_ in f.stacks] for f in g.families] == [[None, 32, 64], [24], [None]]
    assert [f.padded for f in g.families] == [False, True, False]
    assert g.tensors == [6, 0, 5, 4, 1, 2, 3]


def test_values_kept_in_a_padding_add_nothing_where_they_land():
    """A padded tensor's chunks past its edge hold zeros; what top-k keeps there travels (the
    per-tensor wire format), is quantized with the rest, and lands nowhere: position 0 with
    +0.0 from the encode (e' − 0 = e') and −0.0 from a read (a sum + (−0.0) is the sum)."""
    shapes = [(37,), (16, 16)]                                   # (37,) pads to 48: 3 chunks of 16, 11 zeros
    g = GroupedSparseLoCo(SparseLoCoTopK(topk=128, chunk=16), shapes, "cpu")   # k = 8 of 16: zeros are kept
    x = _x(shapes, 0)
    message, positions, values = _encode(g, x)
    padding = g.padding.clone()
    assert padding.any() and bool((positions[padding] == 0).all()) and bool((values[padding] == 0).all())
    read_positions, read_values, _ = g.read(torch.stack([message]))
    assert torch.equal(g.received_padding[0], padding)
    assert bool((read_values[0][padding].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).all())
