"""thinwire.wire.indices: the 'packed' and 'elias-fano' codings of chunk-local indices, against a
bit-by-bit reference written from the definition (lows, then per row a bitmap with bit
(idx_i >> L) + i set), the sizes against the formula, and malformed bytes refused."""

import math

import pytest
import torch

from thinwire.wire import EliasFanoIndices, index_coding, pack_flags, unpack_flags

CASES = [(32, 1024), (44, 1024), (1, 16), (16, 16), (9, 16), (3, 7), (1, 1), (2, 2), (128, 4096), (5, 10)]


def _sorted_rows(rows: int, k: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=gen)[:k].sort().values for _ in range(rows)])


def _reference_bits(idx: torch.Tensor, n: int) -> list[int]:
    """The Elias-Fano stream bit by bit: L = floor(log2(n / k)); every row's lows (L bits each,
    least significant first), then every row's bitmap of k + floor((n - 1) / 2^L) + 1 bits."""
    rows, k = idx.shape
    low = int(math.floor(math.log2(n / k) + 1e-12))
    width = k + (n - 1) // 2 ** low + 1
    lows, uppers = [], []
    for row in idx.tolist():
        for value in row:
            lows += [(value >> b) & 1 for b in range(low)]
        bitmap = [0] * width
        for i, value in enumerate(row):
            bitmap[value // 2 ** low + i] = 1
        uppers += bitmap
    lows += [0] * (-len(lows) % 8)            # each stream ends on a byte, zero-padded
    uppers += [0] * (-len(uppers) % 8)
    return lows + uppers


def _bytes(bits: list[int]) -> torch.Tensor:
    return torch.tensor([sum(b << j for j, b in enumerate(bits[i: i + 8])) for i in range(0, len(bits), 8)],
                        dtype=torch.uint8)


@pytest.mark.parametrize("k,n", CASES)
def test_elias_fano_bytes_are_the_definitions_and_decode_back(k, n):
    idx = _sorted_rows(7, k, n)
    coding = index_coding("elias-fano", k, n)
    out = coding.pack(idx, torch.empty(coding.nbytes(7), dtype=torch.uint8))
    assert torch.equal(out, _bytes(_reference_bits(idx, n)))
    assert torch.equal(coding.unpack(out, 7), idx)


@pytest.mark.parametrize("k,n", CASES)
def test_packed_decodes_back_in_the_order_given(k, n):
    gen = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(5)])      # not sorted
    coding = index_coding("packed", k, n)
    assert coding.nbytes(5) == math.ceil(5 * k * max(1, math.ceil(math.log2(n))) / 8)
    assert torch.equal(coding.unpack(coding.pack(idx, torch.empty(coding.nbytes(5), dtype=torch.uint8)), 5), idx)


def test_elias_fano_at_sparselocos_density_takes_7_bits_an_index_against_10():
    assert index_coding("elias-fano", 32, 1024).nbytes(1000) == 1000 * (32 * 5 + 64) // 8      # 224 bits a chunk
    assert index_coding("packed", 32, 1024).nbytes(1000) == 1000 * 32 * 10 // 8


def _coded(k=4, n=64, rows=3):
    coding = index_coding("elias-fano", k, n)
    idx = _sorted_rows(rows, k, n, seed=2)
    return coding, idx, coding.pack(idx, torch.empty(coding.nbytes(rows), dtype=torch.uint8))


def test_a_bitmap_with_a_bit_too_many_or_too_few_is_refused():
    coding, idx, out = _coded()
    lows = math.ceil(3 * 4 * coding.low / 8)
    flags = unpack_flags(out[lows:], 3 * coding.bitmap)
    for flip in (flags.nonzero()[0, 0], (~flags).nonzero()[0, 0]):
        bad = flags.clone()
        bad[flip] = ~bad[flip]
        bytes_ = torch.cat([out[:lows], pack_flags(bad)])
        with pytest.raises(ValueError, match="bitmap holds [35] indices, expected 4"):
            coding.unpack(bytes_, 3)


def test_an_index_twice_and_an_index_out_of_range_are_refused():
    coding = EliasFanoIndices(2, 6)                                 # L = 1, bitmap of 2 + 2 + 1 bits
    twice = torch.cat([torch.tensor([0b11], dtype=torch.uint8),   # lows 1, 1
                       pack_flags(torch.tensor([True, True, False, False, False]))])    # uppers 0, 0
    with pytest.raises(ValueError, match="not strictly ascending"):
        coding.unpack(twice, 1)
    beyond = torch.cat([torch.tensor([0b10], dtype=torch.uint8),  # lows 0, 1
                        pack_flags(torch.tensor([True, False, False, False, True]))])   # uppers 0, 3
    with pytest.raises(ValueError, match="index 7 out of range for a chunk of 6"):
        coding.unpack(beyond, 1)


def test_an_unknown_coding_is_a_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="indices must be one of"):
        index_coding("gamma", 4, 64)


@pytest.mark.parametrize("count", [0, 5, 8, 77, 4096])
def test_flags_pack_as_pack_bits_of_width_one(count):
    """Whole bytes by the multiply-gather, a tail of fewer than 8 as pack_bits does it."""
    from thinwire.wire import pack_bits
    flags = torch.rand(count, generator=torch.Generator().manual_seed(3)) > 0.5
    assert torch.equal(pack_flags(flags), pack_bits(flags.long(), 1))
    assert torch.equal(unpack_flags(pack_flags(flags), count), flags)
    assert torch.equal(pack_flags(torch.ones(count, dtype=torch.bool)), pack_bits(torch.ones(count, dtype=torch.long), 1))


def test_flags_must_be_bool():
    flags = torch.zeros(8, dtype=torch.bool)
    with pytest.raises(ValueError, match="flags must be a bool tensor"):
        pack_flags(flags.long())
