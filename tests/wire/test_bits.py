"""Bit packing: byte layouts against plain-Python references, round trips, and argument checks."""

import math
import os
import struct
import subprocess
import sys

import pytest
import torch

from thinwire.audit import StepAudit
from thinwire.wire import checks, index_width, pack_bits, pack_signs, packed_nbytes, unpack_bits, unpack_signs


def ref_pack(values, width):
    """One bit at a time: value i's bit b is stream bit i*width + b, stream bit j is bit j%8 of byte j//8."""
    out = bytearray(math.ceil(len(values) * width / 8))
    for i, v in enumerate(values):
        for b in range(width):
            j = i * width + b
            out[j // 8] |= ((v >> b) & 1) << (j % 8)
    return list(out)


def ref_pack_bigint(values, width):
    """The same stream read as one little-endian integer."""
    total = sum(v << (i * width) for i, v in enumerate(values))
    return list(total.to_bytes(math.ceil(len(values) * width / 8), "little"))


def random_values(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 2 ** width, (n,), generator=g, dtype=torch.int64)
    if n >= 2:  # the extremes
        v[0], v[-1] = 2 ** width - 1, 0
    return v


@pytest.mark.parametrize("width", range(1, 33))
@pytest.mark.parametrize("n", [0, 1, 7, 9, 1001])
def test_round_trip_every_width_matches_reference(width, n):
    v = random_values(n, width, seed=width * 1000 + n)
    packed = pack_bits(v, width)
    assert packed.dtype == torch.uint8 and packed.shape == (packed_nbytes(n, width),)
    assert packed.tolist() == ref_pack_bigint(v.tolist(), width)
    if n <= 9:
        assert packed.tolist() == ref_pack(v.tolist(), width)
    back = unpack_bits(packed, width, n)
    assert back.dtype == torch.int64 and torch.equal(back, v)


@pytest.mark.parametrize("width, values, expected", [
    (12, [0xABC, 0x123], [0xBC, 0x3A, 0x12]),
    (1, [1, 0, 1, 1], [0b00001101]),
    (3, [5, 3, 7], [0xDD, 0x01]),          # 5 | 3 << 3 | 7 << 6 = 0x1DD
    (4, [0x1, 0xF, 0x7], [0xF1, 0x07]),
    (9, [0x1FF], [0xFF, 0x01]),
    (8, [0, 1, 255], [0, 1, 255]),
    (16, [0x1234, 0xFFFF], list(struct.pack("<2H", 0x1234, 0xFFFF))),
    (32, [0xDEADBEEF, 1, 0xFFFFFFFF], list(struct.pack("<3I", 0xDEADBEEF, 1, 0xFFFFFFFF))),
])
def test_exact_byte_layout(width, values, expected):
    assert pack_bits(torch.tensor(values), width).tolist() == expected
    assert unpack_bits(torch.tensor(expected, dtype=torch.uint8), width, len(values)).tolist() == values


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_any_integer_dtype_and_shape_is_flattened(dtype):
    v = torch.tensor([[3, 0, 127], [64, 5, 1]], dtype=dtype)
    assert pack_bits(v, 7).tolist() == ref_pack([3, 0, 127, 64, 5, 1], 7)


@pytest.mark.parametrize("width", [5, 8, 12, 16, 32])
def test_out_writes_into_a_view_without_touching_neighbours(width):
    v = random_values(13, width, seed=width)
    n = packed_nbytes(13, width)
    big = torch.full((n + 10,), 0xA5, dtype=torch.uint8)
    view = big[3: 3 + n]                                   # an unaligned offset
    result = pack_bits(v, width, out=view)
    assert result.data_ptr() == view.data_ptr()
    assert big[3: 3 + n].tolist() == ref_pack_bigint(v.tolist(), width)
    assert big[:3].tolist() == [0xA5] * 3 and big[3 + n:].tolist() == [0xA5] * 7
    assert torch.equal(unpack_bits(big[3: 3 + n], width, 13), v)


@pytest.mark.parametrize("out", [
    torch.empty(4, dtype=torch.uint8),                     # one byte short
    torch.empty(6, dtype=torch.uint8),                     # one byte long
    torch.empty(5, dtype=torch.int8),                      # wrong dtype
    torch.empty(5, 1, dtype=torch.uint8),                  # not 1-D
    torch.empty(10, dtype=torch.uint8)[::2],               # not contiguous
])
def test_out_of_wrong_size_dtype_or_layout_raises(out):
    with pytest.raises(ValueError, match="out"):
        pack_bits(torch.arange(4), 10, out=out)            # needs 5 bytes


@pytest.fixture
def debug_checks():
    previous = checks.set_enabled(True)
    yield
    checks.set_enabled(previous)


@pytest.mark.parametrize("values, width", [([0, 8], 3), ([-1, 2], 3), ([0, 2 ** 32], 32), ([256], 8)])
def test_out_of_range_values_raise_with_debug_checks(values, width, debug_checks):
    with pytest.raises(ValueError, match="values must be in"):
        pack_bits(torch.tensor(values), width)


def test_the_range_check_reads_nothing_without_debug_checks():
    """Off (the default): packing in-range values makes no host read; on: one (aminmax -> int)."""
    values = torch.arange(10)
    for on, reads in ((False, 0), (True, 2)):
        previous = checks.set_enabled(on)
        try:
            with StepAudit() as audit:
                out = pack_bits(values, 4)
        finally:
            checks.set_enabled(previous)
        assert audit.host_reads == reads
        assert out.tolist() == ref_pack(list(range(10)), 4)


def test_the_switch_is_read_from_the_environment_at_import():
    """In a fresh interpreter (none of this process's imports), the module imported with each
    value and re-imported (importlib.reload runs its import-time code again) with the next:
    one interpreter for the three values instead of three (~3 s of torch import each)."""
    code = ("import importlib, os, sys; import thinwire.wire.checks as c\n"
            "for value in sys.argv[1:]:\n"
            f"    os.environ[{checks.ENV!r}] = value; print(importlib.reload(c).enabled())")
    values = {"1": "True", "0": "False", "": "False"}
    env = {**os.environ, checks.ENV: "1"}                 # the first import sees "1", as the first value
    out = subprocess.run([sys.executable, "-c", code, *values], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == list(values.values())


def test_float_values_raise():
    with pytest.raises(ValueError, match="values must be an integer tensor"):
        pack_bits(torch.tensor([1.0, 2.0]), 4)


@pytest.mark.parametrize("width", [0, 33, -1])
def test_bad_width_raises(width):
    with pytest.raises(ValueError, match=f"width must be in 1..32, got {width}"):
        pack_bits(torch.tensor([0]), width)
    with pytest.raises(ValueError, match="width"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), width, 1)


def test_unpack_wrong_buffer_raises():
    with pytest.raises(ValueError, match="expected 3 bytes for 2 values of 12 bits, got 4"):
        unpack_bits(torch.zeros(4, dtype=torch.uint8), 12, 2)
    with pytest.raises(ValueError, match="expected 3 bytes for 2 values of 12 bits, got 2"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 12, 2)
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(torch.zeros(3, dtype=torch.int8), 12, 2)
    with pytest.raises(ValueError, match="1-D"):
        unpack_bits(torch.zeros(1, 3, dtype=torch.uint8), 12, 2)
    with pytest.raises(ValueError, match="count"):
        unpack_bits(torch.zeros(0, dtype=torch.uint8), 12, -1)


def test_empty():
    assert pack_bits(torch.zeros(0, dtype=torch.int64), 12).shape == (0,)
    assert unpack_bits(torch.zeros(0, dtype=torch.uint8), 12, 0).shape == (0,)
    assert pack_signs(torch.zeros(0)).shape == (0,)
    assert unpack_signs(torch.zeros(0, dtype=torch.uint8), 0).shape == (0,)


@pytest.mark.parametrize("count, width", [(0, 5), (1, 1), (7, 1), (8, 1), (9, 1), (3, 12), (1001, 13), (5, 32)])
def test_packed_nbytes(count, width):
    assert packed_nbytes(count, width) == math.ceil(count * width / 8)


def test_packed_nbytes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        packed_nbytes(-1, 8)
    with pytest.raises(ValueError, match="width must be in 1..32, got 0"):
        packed_nbytes(1, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 255, 256, 257, 4095, 4096, 4097, 2 ** 32, 2 ** 53 + 1])
def test_index_width(n):
    bits = 1
    while 2 ** bits < n:                                   # smallest width whose codes cover 0..n-1
        bits += 1
    assert index_width(n) == bits
    assert index_width(1) == 1 and index_width(4096) == 12 and index_width(4097) == 13


@pytest.mark.parametrize("n", [0, -3])
def test_index_width_rejects_n_below_one(n):
    with pytest.raises(ValueError, match=f"n must be >= 1, got {n}"):
        index_width(n)


def test_signs_layout_zero_is_positive_and_nan_negative():
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, float("nan"), 3.0, -1e-30, float("inf"), -float("inf")])
    expected_bits = [1, 0, 1, 1, 0, 1, 0, 1, 0]
    assert pack_signs(x).tolist() == ref_pack(expected_bits, 1)
    assert unpack_signs(pack_signs(x), 9).tolist() == [1.0 if b else -1.0 for b in expected_bits]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_signs_round_trip(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[0] = 0.0
    packed = pack_signs(x)
    assert packed.tolist() == ref_pack((x >= 0).long().tolist(), 1)
    back = unpack_signs(packed, n, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert back.float().tolist() == [1.0 if v >= 0 else -1.0 for v in x.tolist()]


def test_signs_out_and_bad_buffers():
    x = torch.tensor([[-1.0, 2.0, 3.0], [0.0, -5.0, 1.0], [2.0, 2.0, -2.0]])   # 9 signs -> 2 bytes
    big = torch.zeros(5, dtype=torch.uint8)
    pack_signs(x, out=big[1:3])
    assert big.tolist() == [0] + ref_pack([0, 1, 1, 1, 0, 1, 1, 1, 0], 1) + [0, 0]
    with pytest.raises(ValueError, match="out"):
        pack_signs(x, out=big[1:4])
    with pytest.raises(ValueError, match="expected 2 bytes for 9 signs, got 3"):
        unpack_signs(big[:3], 9)
    with pytest.raises(ValueError, match="dtype"):
        unpack_signs(big[:2], 9, dtype=torch.int32)
