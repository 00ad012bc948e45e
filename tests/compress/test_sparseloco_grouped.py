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


@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("name", SHAPE_SETS)
def test_bytes_and_decoded_values_are_the_per_tensor_ones(name, settings):
    shapes = SHAPE_SETS[name]
    comp = SparseLoCoTopK(topk=32, chunk=16, **settings)
    g = GroupedSparseLoCo(comp, shapes, "cpu")
    for seed in (0, 1):                                       # buffers reused: a second sync
        x = _x(shapes, seed)
        message, positions, values = _encode(g, x)
        decoded = torch.zeros_like(x).index_put_((positions,), values)
        for i in g.tensors:
            want = torch.empty(comp.payload_nbytes(g.shapes[i]), dtype=torch.uint8)
            comp.encode(_tensor(g, x, i).clone(), want)
            assert torch.equal(g.payloads[i].of(message), want), (i, seed)
            assert torch.equal(_tensor(g, decoded, i), comp.decode(want, g.shapes[i])), (i, seed)
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
    assert g.alone == [1]                                        # (37, 24) pads its rows
    # 16 x 16 chunks: (32, 16) one chunk wide (chunk-major is row-major: the None stack), then
    # cols 32 (two tensors stacked), cols 64; 1 x 16 chunks: all row-major
    assert [f.members for f in g.families] == [[6, 0, 5, 4], [2, 3]]
    assert [[cols for cols, *_ in f.stacks] for f in g.families] == [[None, 32, 64], [None]]
    assert g.tensors == [6, 0, 5, 4, 2, 3]
