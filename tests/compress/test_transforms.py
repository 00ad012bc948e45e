"""Chunk transforms in image layout against per-chunk computations in float64."""

import math

import pytest
import torch

from thinwire.compress import ChunkPlan, ChunkTransform


def dct_basis64(n: int) -> torch.Tensor:
    """Orthonormal DCT-II, rows = basis functions, from its defining formula in float64."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    j = torch.arange(n, dtype=torch.float64)[None, :]
    scale = torch.where(k == 0, math.sqrt(1 / n), math.sqrt(2 / n))
    return scale * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))


def test_image_layout_puts_each_chunks_coefficients_where_the_chunk_lies():
    plan = ChunkPlan.for_shape((8, 12), 4)                 # 2 x 3 chunks of 4 x 4
    x = torch.randn(8, 12)
    image = ChunkTransform("dct").forward_image(x, plan)
    d = dct_basis64(4)
    for a in range(2):
        for b in range(3):
            block = x[4 * a: 4 * a + 4, 4 * b: 4 * b + 4].double()
            assert torch.allclose(image[4 * a: 4 * a + 4, 4 * b: 4 * b + 4].double(), d @ block @ d.T, atol=1e-5)


def test_forward_folds_decay_and_scale_into_out():
    plan = ChunkPlan.for_shape((16, 24), 8)
    x, start = torch.randn(16, 24), torch.randn(16, 24)
    transform = ChunkTransform("dct")
    out = transform.forward_image(x, plan, out=start.clone(), beta=0.9, alpha=0.1)
    assert torch.allclose(out, 0.9 * start + 0.1 * transform.forward_image(x, plan), atol=1e-6)


def test_rows_only_padding_needs_no_padded_copy():
    plan = ChunkPlan.for_shape((13, 20), 8)                # rows 13 -> 16 padded, cols 20 in chunks of 5
    assert (plan.padded_rows, plan.padded_cols) == (16, 20)
    x = torch.randn(13, 20)
    view = plan.transform_input(x)
    assert view.data_ptr() == x.data_ptr() and view.shape == (13, 20)
    transform = ChunkTransform("dct")
    assert torch.equal(transform.forward_image(view, plan), transform.forward_image(plan.padded_matrix(x), plan))


@pytest.mark.parametrize("kind", ["dct", "random", "identity"])
@pytest.mark.parametrize("shape", [(13, 20), (37, 24), (10, 37), (130,)])
def test_inverse_undoes_forward_through_scratch(kind, shape):
    plan = ChunkPlan.for_shape(shape, 8)
    x = torch.randn(shape)
    scratch = torch.full((plan.padded_numel + 5,), float("nan"))   # stale content must not leak
    transform = ChunkTransform(kind, seed=7)
    image = transform.forward_image(plan.padded_matrix(x), plan, step=3, scratch=scratch)
    back = transform.inverse_image(image, plan, step=3, scratch=scratch)
    assert torch.allclose(back, plan.padded_matrix(x), atol=1e-5)   # padding comes back as zeros
