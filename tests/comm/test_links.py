"""The link-byte table against explicit message-by-message simulations of each algorithm."""

import pytest

from thinwire.comm import COLLECTIVES, link_bytes


def simulate_ring_all_reduce(n_elems: int, w: int) -> int:
    """Bytes one rank sends in ring reduce-scatter + ring all-gather of n_elems 1-byte elements
    split in w equal chunks: each of the 2(w-1) rounds forwards one chunk to the neighbour."""
    chunk = n_elems // w
    return sum(chunk for _round in range(2 * (w - 1)))


def simulate_ring_all_gather(n: int, w: int) -> int:
    """Each of the w-1 rounds forwards one rank's whole contribution to the neighbour."""
    return sum(n for _round in range(w - 1))


def simulate_all_to_all(n: int, w: int) -> int:
    """A rank keeps its own part and sends one part of n/w bytes to each of the w-1 peers."""
    return sum(n // w for peer in range(w) if peer != 0)


@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
def test_ring_formulas_match_simulation(w):
    n = 24 * 1000  # divisible by every w above, so the simulation needs no rounding
    assert link_bytes("all_reduce", n, w) == (simulate_ring_all_reduce(n, w),) * 2
    assert link_bytes("all_gather", n, w) == (simulate_ring_all_gather(n, w),) * 2
    assert link_bytes("all_to_all", n, w) == (simulate_all_to_all(n, w),) * 2


def test_rooted_collectives_are_asymmetric():
    # gather: 3 workers each send 100 bytes to the root, which receives all three.
    assert link_bytes("gather", 100, 4, is_root=False) == (100, 0)
    assert link_bytes("gather", 100, 4, is_root=True) == (0, 300)
    # star broadcast: the source sends one copy to each of 3 peers.
    assert link_bytes("broadcast", 100, 4, is_root=True) == (300, 0)
    assert link_bytes("broadcast", 100, 4, is_root=False) == (0, 100)


@pytest.mark.parametrize("op", COLLECTIVES)
def test_single_rank_moves_nothing(op):
    assert link_bytes(op, 12345, 1, is_root=True) == (0, 0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="op"):
        link_bytes("reduce_scatter_v", 1, 2)
    with pytest.raises(ValueError, match="nbytes"):
        link_bytes("all_reduce", -1, 2)
    with pytest.raises(ValueError, match="world_size"):
        link_bytes("all_reduce", 1, 0)
