"""Orthogonalisation against torch.optim.Muon's own, and the random bases."""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from thinwire.ops import NS_COEFFICIENTS, NS_EPS, NS_STEPS, muon_scale, orthogonalize, random_orthogonal


@pytest.mark.parametrize("shape", [(16, 16), (32, 8), (8, 40)])
def test_orthogonalize_matches_torch_muon(shape):
    g = torch.randn(shape)
    expected = _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, NS_STEPS, NS_EPS)
    assert torch.equal(orthogonalize(g), expected)


def test_orthogonalize_gives_singular_values_near_one():
    s = torch.linalg.svdvals(orthogonalize(torch.randn(64, 32)).float())
    assert s.min() > 0.5 and s.max() < 1.5


def test_muon_scale():
    assert muon_scale((768, 3072)) == 1.0
    assert muon_scale((3072, 768)) == 2.0


def test_random_orthogonal_is_orthogonal_and_seeded():
    q = random_orthogonal(16, seed=7, dtype=torch.float64)
    assert torch.allclose(q @ q.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
    assert torch.equal(random_orthogonal(16, seed=7), random_orthogonal(16, seed=7))
    assert not torch.equal(random_orthogonal(16, seed=7), random_orthogonal(16, seed=8))


def test_bad_shape_raises():
    with pytest.raises(ValueError, match="2-D"):
        orthogonalize(torch.randn(3))
