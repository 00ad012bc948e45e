"""Orthogonalisation against torch.optim.Muon's own, and the random bases."""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from thinwire.ops import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, ascending, largest_indices, muon_scale, orthogonalize,
                          random_orthogonal)
from thinwire.ops.select import _group_size


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


def _kth_largest_sorted(x: torch.Tensor, k: int) -> torch.Tensor:
    """Reference: the k largest values of each row by a full descending sort."""
    return x.sort(dim=-1, descending=True).values[:, :k]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])   # cuda: the Triton selection where installed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 7, 58])
def test_largest_indices_pick_the_k_largest_values(k, device):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, 300, generator=g).abs()
    x[0, :20] = 0.0                                            # ties at zero
    x[1, 5], x[2, 7], x[3, 0] = float("inf"), float("nan"), 1e-40   # inf, NaN, a subnormal
    x[4] = torch.finfo(torch.float32).max * torch.rand(300, generator=g)
    idx = largest_indices(x.to(device), k).cpu()
    assert idx.shape == (9, k) and idx.dtype == torch.int64
    assert all(len(set(row.tolist())) == k for row in idx)     # k distinct positions per row
    picked = x.gather(-1, idx).sort(dim=-1, descending=True).values
    expected = _kth_largest_sorted(x, k)
    assert torch.equal(picked.isnan(), expected.isnan())
    assert torch.equal(picked.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, k", [(4096, 128), (1024, 15), (2048, 1), (4096, 58)])
def test_long_rows_select_in_two_levels_and_pick_the_k_largest_values(n, k, device):
    """Rows long enough for the two-level selection (groups of g > 1 strided elements), with
    ties at zero, inf, NaN and the row's k largest crowded into one group."""
    assert _group_size(n, k) > 1
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(6, n, generator=g).abs()
    x[0, : n // 2] = 0.0
    x[1, 5], x[2, 7], x[3, 0] = float("inf"), float("nan"), 1e-40
    width = n // _group_size(n, k)
    x[4, torch.arange(0, n, width)[: k]] += 100.0              # group 0 holds the largest values
    x[5, 3] = 1e9
    idx = largest_indices(x.to(device), k).cpu()
    assert idx.shape == (6, k) and all(len(set(row.tolist())) == k for row in idx)
    picked = x.gather(-1, idx).sort(dim=-1, descending=True).values
    expected = _kth_largest_sorted(x, k)
    assert torch.equal(picked.isnan(), expected.isnan())
    assert torch.equal(picked.nan_to_num(), expected.nan_to_num())


def _triton_kernel():
    try:
        from thinwire.ops import select_triton
    except ImportError:
        return None
    return select_triton


if "cuda" in DEVICES and _triton_kernel() is not None:                 # defined only where it can run
    def test_triton_selection_is_ascending_takes_the_lowest_tied_indices_and_reads_strided_rows():
        """The CUDA kernel's own promises (docstring of ops.select_triton): ascending indices,
        the lowest indices among values equal to the k-th largest, rows of any length up to
        MAX_ROW read through their stride, -0.0 as 0."""
        x = torch.zeros(4, 100, device="cuda")
        x[0, 5] = 1.0                                           # one value, then the first three zeros
        x[1, ::10] = 2.0                                        # ten ties for four places
        x[2] = 3.0
        x[3, :50] = -0.0                                        # read as 0: ties with the zeros after it
        row_largest = _triton_kernel().row_largest
        for warps in (1, 2, 4, 16):
            assert row_largest(x, 4, warps).tolist() == [[0, 1, 2, 5], [0, 10, 20, 30], [0, 1, 2, 3], [0, 1, 2, 3]]
        g = torch.Generator().manual_seed(3)
        wide = torch.rand(7, 5000, generator=g).cuda()[:, 13:4013]    # rows of 4000, stride 5000
        idx = row_largest(wide, 33)
        assert bool((idx.diff(dim=-1) > 0).all())
        assert torch.equal(wide.gather(-1, idx).sort(dim=-1).values, wide.topk(33).values.sort(dim=-1).values)


def test_largest_indices_non_float32_and_strided_inputs_match_topk():
    x = torch.rand(6, 50, dtype=torch.float64)
    assert set(largest_indices(x, 5)[2].tolist()) == set(x[2].topk(5).indices.tolist())
    strided = torch.rand(50, 6).t()                             # not contiguous: the float path
    assert set(largest_indices(strided, 5)[3].tolist()) == set(strided[3].topk(5).indices.tolist())


@pytest.mark.parametrize("rows, k, n", [(300, 32, 1024), (5, 1, 7), (4, 16, 16), (1, 3, 2 ** 31 - 1)])
def test_ascending_sorts_every_row(rows, k, n):
    """Flat int32 keys where rows · n fits, a row sort beyond (the last case): each row's values
    ascending, as a per-row sorted() in Python orders them."""
    gen = torch.Generator().manual_seed(rows)
    idx = torch.stack([torch.randperm(min(n, 4096), generator=gen)[:k] * (n // min(n, 4096)) for _ in range(rows)])
    out = ascending(idx, n)
    assert out.dtype == torch.int64 and out.shape == idx.shape
    assert out.tolist() == [sorted(row) for row in idx.tolist()]
