"""Chunk geometry: sizes, padding instead of chunks of 1, and lossless chunk round trips."""

import pytest
import torch

from thinwire.compress import ChunkPlan, chunk_size, matrix_shape


@pytest.mark.parametrize("n, target, expected", [
    (10, 64, (10, 10)),          # fits in one chunk
    (64, 64, (64, 64)),
    (768, 64, (64, 768)),        # divisor 64
    (96, 64, (48, 96)),          # divisor 48 >= 32: no padding
    (200, 64, (50, 200)),
    (50257, 64, (64, 50304)),    # GPT-2 vocab = 29 * 1733: pad to 786 chunks of 64
    (67, 64, (64, 128)),         # prime: pad, never chunks of 1
    (37, 16, (16, 48)),
])
def test_chunk_size(n, target, expected):
    assert chunk_size(n, target) == expected


def test_matrix_view_of_shapes():
    assert matrix_shape(()) == (1, 1)
    assert matrix_shape((7,)) == (1, 7)
    assert matrix_shape((3, 5)) == (3, 5)
    assert matrix_shape((8, 3, 2, 2)) == (8, 12)   # conv weight: out x (in * kh * kw)


@pytest.mark.parametrize("shape", [(), (5,), (130,), (37, 24), (96, 200), (8, 3, 5, 5)])
def test_chunks_round_trip_and_pad_with_zeros(shape):
    plan = ChunkPlan.for_shape(shape, 16)
    x = torch.randn(shape)
    chunks = plan.to_chunks(x)
    gr, gc = plan.grid
    assert chunks.shape == (gr, gc, plan.chunk_rows, plan.chunk_cols)
    assert torch.equal(plan.from_chunks(chunks), x)
    # The padding holds zeros only, and the chunks hold every element exactly once.
    assert chunks.abs().sum().item() == pytest.approx(x.abs().sum().item(), rel=1e-6)
    assert chunks.numel() == plan.padded_rows * plan.padded_cols


def test_chunk_holds_a_contiguous_block():
    plan = ChunkPlan.for_shape((32, 48), 16)
    x = torch.arange(32 * 48.0).view(32, 48)
    chunks = plan.to_chunks(x)
    assert torch.equal(chunks[1, 2], x[16:32, 32:48])


def test_empty_tensor_rejected():
    with pytest.raises(ValueError, match="empty"):
        ChunkPlan.for_shape((0, 4), 16)
