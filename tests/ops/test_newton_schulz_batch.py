"""Batched Newton–Schulz (`orthogonalize_batch`): on CPU each matrix comes out bit for bit as
`orthogonalize` gives it alone, wide, square and tall (a tall batch transposed as a view, as
one tall matrix is: (768, 256) comes out otherwise from a contiguous transposed copy), in
launches that do not grow with the batch."""

from __future__ import annotations

import pytest
import torch

from thinwire.audit import StepAudit
from thinwire.ops.newton_schulz import orthogonalize, orthogonalize_batch


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (24, 24), (37, 24), (768, 256)], ids=str)
def test_each_matrix_as_orthogonalize_gives_it(shape):
    g = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    expected = torch.stack([orthogonalize(m) for m in g])
    got = orthogonalize_batch(g)
    assert got.dtype == torch.bfloat16 and got.shape == g.shape
    assert torch.equal(got, expected)
    assert torch.equal(orthogonalize_batch(g.bfloat16()), expected)          # bf16 in: the same


def test_launches_do_not_grow_with_the_batch():
    counts = []
    for batch in (1, 9):
        g, audit = torch.randn(batch, 8, 12), StepAudit()
        with audit:
            orthogonalize_batch(g)
        counts.append(audit.launches)
    assert counts[0] == counts[1] == 1 + 3 + 3 * 5                          # bf16, norm, clamp, div; 3 GEMMs a step


def test_a_batch_needs_three_dimensions():
    with pytest.raises(ValueError, match="batch, rows, cols"):
        orthogonalize_batch(torch.randn(4, 4))
