"""Value codecs: documented byte layouts (checked with struct/numpy), exactness, error bounds."""

import struct

import numpy as np
import pytest
import torch

from thinwire.wire import CODEC_NAMES, VALUE_FORMATS, SignCodec, ValueFormat, get_codec

SHAPES = [(0, 5), (3, 0), (1, 1), (5, 7), (2, 1001)]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ref_sign_bytes(flat_values):
    bits = [1 if v >= 0 else 0 for v in flat_values]
    return [sum(b << k for k, b in enumerate(bits[i: i + 8])) for i in range(0, len(bits), 8)]


def documented_nbytes(name, rows, cols):
    per_value = {"fp32": 4 * rows * cols, "bf16": 2 * rows * cols, "fp16": 2 * rows * cols,
                 "int8": 4 * rows + rows * cols, "sign": 4 * rows + -(-rows * cols // 8), "signbit": -(-rows * cols // 8),
                 "2bit": 16 * rows + -(-rows * cols // 4), "8bit": 1024 * rows + rows * cols}
    return per_value[name]


def test_names_and_flags():
    assert CODEC_NAMES == ("fp32", "bf16", "fp16", "int8", "sign", "signbit", "2bit", "8bit")
    for name in CODEC_NAMES:
        codec = get_codec(name)
        assert codec.name == name and codec.lossless == (name == "fp32")


def test_value_format_table():
    """The one table of value-format names: CODEC_NAMES derives from it, and each codec's
    size, lossless flag and error factor agree with its row."""
    assert tuple(VALUE_FORMATS) == ("fp32", "bf16", "fp16", "int8", "sign", "signbit", "2bit", "8bit", "natural")
    assert all(isinstance(fmt, ValueFormat) for fmt in VALUE_FORMATS.values())
    assert CODEC_NAMES == tuple(name for name, fmt in VALUE_FORMATS.items() if fmt.codec)
    assert not VALUE_FORMATS["natural"].codec
    with pytest.raises(TypeError):
        VALUE_FORMATS["fp8"] = VALUE_FORMATS["fp32"]                      # read-only
    x = randn(4, 999, seed=9) * 100
    for name in CODEC_NAMES:
        fmt, codec = VALUE_FORMATS[name], get_codec(name)
        for rows, cols in SHAPES:
            assert codec.nbytes(rows, cols) == 4 * rows * fmt.row_floats + -(-rows * cols * fmt.bits // 8)
        assert fmt.scaled == (fmt.row_floats > 0)
        assert codec.lossless == fmt.lossless
        err = float((codec.roundtrip(x) - x).double().norm() ** 2 / x.double().norm() ** 2)
        if fmt.lossless:
            assert err == 0.0 and fmt.error_factor == 0.0
        if fmt.error_factor is not None:
            assert err <= fmt.error_factor


def test_unknown_codec_and_scale_raise():
    with pytest.raises(ValueError, match="values must be one of .*'fp32'.*'sign'.*got 'bogus'"):
        get_codec("bogus")
    with pytest.raises(ValueError, match="scale must be one of"):
        SignCodec(scale="bogus")


@pytest.mark.parametrize("name", CODEC_NAMES + ("sign_rms",))
@pytest.mark.parametrize("shape", SHAPES)
def test_nbytes_matches_layout_and_encoding(name, shape):
    codec = SignCodec("rms") if name == "sign_rms" else get_codec(name)
    expected = documented_nbytes(codec.name, *shape)
    buf = codec.encode(randn(*shape))
    assert codec.nbytes(*shape) == expected and buf.dtype == torch.uint8 and buf.shape == (expected,)
    assert codec.decode(buf, *shape).shape == shape
    assert torch.equal(codec.roundtrip(randn(*shape)), codec.decode(codec.encode(randn(*shape)), *shape))


def test_fp32_is_bit_exact_and_layout_is_little_endian_float32():
    x = torch.tensor([[1.5, -0.0, 1e-45, 3.4e38], [float("inf"), float("nan"), -7.25, 0.1]])
    codec = get_codec("fp32")
    buf = codec.encode(x)
    assert bytes(buf.tolist()) == struct.pack("<8f", *x.flatten().tolist())
    assert torch.equal(codec.decode(buf, 2, 4).view(torch.int32), x.view(torch.int32))


def test_bf16_exact_on_representable_values_and_layout():
    # Zero the low 16 bits of float32 patterns: exactly the bfloat16-representable values.
    x = (randn(4, 9).view(torch.int32) & ~0xFFFF).view(torch.float32)
    codec = get_codec("bf16")
    buf = codec.encode(x)
    assert torch.equal(codec.decode(buf, 4, 9), x)
    high_halves = b"".join(struct.pack("<f", v)[2:] for v in x.flatten().tolist())
    assert bytes(buf.tolist()) == high_halves


def test_bf16_rounds_to_nearest_even():
    # Ties between neighbours 2**-7 apart go to the even mantissa.
    x = torch.tensor([[1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20]])
    assert get_codec("bf16").roundtrip(x).tolist() == [[1.0, 1 + 2 ** -6, 1 + 2 ** -7]]


def test_fp16_exact_on_representable_values_and_layout():
    values = np.random.default_rng(0).standard_normal((3, 11)).astype(np.float16)
    codec = get_codec("fp16")
    x = torch.from_numpy(values.astype(np.float32))
    buf = codec.encode(x)
    assert bytes(buf.tolist()) == values.astype("<f2").tobytes()
    assert torch.equal(codec.decode(buf, 3, 11), x)


def test_fp16_saturates_finite_values_and_keeps_non_finite():
    x = torch.tensor([[1e6, -1e6, 65519.0, 70000.0, float("inf"), -float("inf")]])
    y = get_codec("fp16").roundtrip(x)
    assert y[0, :4].tolist() == [65504.0, -65504.0, 65504.0, 65504.0]
    assert y[0, 4:].tolist() == [float("inf"), -float("inf")]
    assert get_codec("fp16").roundtrip(torch.tensor([[float("nan")]])).isnan().all()


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "int8", "sign"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_is_coded_like_its_float32_value(name, dtype):
    x = randn(3, 10).to(dtype)
    codec = get_codec(name)
    assert torch.equal(codec.encode(x), codec.encode(x.float()))
    assert codec.decode(codec.encode(x), 3, 10).dtype == torch.float32


def test_int8_layout_and_error_bound():
    x = randn(6, 50, seed=1) * torch.tensor([1e-3, 1.0, 1e3, 1e-40, 5.0, 1e30])[:, None]
    codec = get_codec("int8")
    buf = codec.encode(x)
    raw = bytes(buf.tolist())
    scales = np.array(struct.unpack("<6f", raw[:24]), dtype=np.float64)
    q = np.frombuffer(raw[24:], dtype=np.int8).reshape(6, 50).astype(np.float64)
    x64 = x.double().numpy()
    assert np.array_equal(scales, np.abs(x64).max(axis=1))
    assert np.all(np.abs(q - x64 / scales[:, None] * 127) <= 0.5 + 1e-5)   # nearest code
    assert np.all(np.abs(q).max(axis=1) == 127)
    err = (codec.decode(buf, 6, 50).double().numpy() - x64)
    assert np.all(np.abs(err) <= scales[:, None] / 254 * (1 + 1e-5))


def test_int8_zero_row_decodes_to_zeros():
    x = torch.zeros(3, 8)
    x[1] = randn(8)
    y = get_codec("int8").roundtrip(x)
    assert not y.isnan().any()
    assert torch.equal(y[0], torch.zeros(8)) and torch.equal(y[2], torch.zeros(8))
    assert struct.unpack("<3f", bytes(get_codec("int8").encode(x)[:12].tolist()))[0] == 0.0


def test_sign_layout_and_decode_is_sign_times_mean_abs():
    x = randn(4, 13, seed=2)
    x[1, 3] = 0.0
    codec = get_codec("sign")
    raw = bytes(codec.encode(x).tolist())
    mean_abs = np.abs(x.double().numpy()).mean(axis=1)
    np.testing.assert_allclose(struct.unpack("<4f", raw[:16]), mean_abs, rtol=1e-6)
    assert list(raw[16:]) == ref_sign_bytes(x.flatten().tolist())
    signs = np.where(x.numpy() >= 0, 1.0, -1.0)                       # zero decodes as +scale
    np.testing.assert_allclose(codec.decode(codec.encode(x), 4, 13).numpy(), signs * mean_abs[:, None], rtol=1e-6)


def test_sign_rms_preserves_each_row_norm():
    x = randn(5, 33, seed=3) * torch.tensor([1e-3, 1.0, 1e-25, 1e25, 0.5])[:, None]   # x^2 under/overflows
    y = SignCodec(scale="rms").roundtrip(x)
    np.testing.assert_allclose(y.double().norm(dim=1).numpy(), x.double().norm(dim=1).numpy(), rtol=1e-5)
    assert torch.equal(torch.where(x >= 0, 1.0, -1.0), y.sign())


@pytest.mark.parametrize("name", tuple(n for n in CODEC_NAMES if n != "signbit") + ("sign_rms",))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_never_decoded_as_finite(name, bad):
    codec = SignCodec("rms") if name == "sign_rms" else get_codec(name)
    x = randn(2, 10, seed=6)
    x[1, 4] = bad
    y = codec.roundtrip(x)
    assert torch.isfinite(y[0]).all()
    assert not torch.isfinite(y[1, 4])
    if name in ("int8", "sign", "sign_rms", "2bit", "8bit"):            # via the row's scale (levels)
        assert not torch.isfinite(y[1]).any()


def test_mean_abs_scale_minimises_the_sign_code_error():
    x = randn(3, 40, seed=4).double()
    s = get_codec("sign").row_scale(x).double()
    signs = torch.where(x >= 0, 1.0, -1.0).double()

    def err(scale):
        return (x - scale[:, None] * signs).norm(dim=1)

    for factor in (0.9, 0.99, 0.999, 1.001, 1.01, 1.1):
        assert torch.all(err(s) <= err(s * factor))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_out_writes_into_an_unaligned_view_and_decodes_from_it(name):
    codec, x = get_codec(name), randn(3, 10, seed=5)
    n = codec.nbytes(3, 10)
    big = torch.full((n + 8,), 0x5A, dtype=torch.uint8)
    view = big[3: 3 + n]
    assert codec.encode(x, out=view).data_ptr() == view.data_ptr()
    assert torch.equal(view, codec.encode(x))
    assert big[:3].tolist() == [0x5A] * 3 and big[3 + n:].tolist() == [0x5A] * 5
    assert torch.equal(codec.decode(view, 3, 10), codec.roundtrip(x))
    with pytest.raises(ValueError, match="out"):
        codec.encode(x, out=big[: n + 1])


def test_decode_does_not_alias_the_buffer():
    codec = get_codec("fp32")
    buf = codec.encode(torch.ones(2, 2))
    y = codec.decode(buf, 2, 2)
    buf.zero_()
    assert torch.equal(y, torch.ones(2, 2))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_malformed_buffers_and_inputs_raise(name):
    codec = get_codec(name)
    buf = codec.encode(randn(2, 9))
    with pytest.raises(ValueError, match=f"expected a 1-D uint8 tensor of {buf.numel()} bytes"):
        codec.decode(buf[:-1], 2, 9)
    with pytest.raises(ValueError, match="1-D uint8"):
        codec.decode(torch.cat([buf, buf[:1]]), 2, 9)
    with pytest.raises(ValueError, match="1-D uint8"):
        codec.decode(buf.view(torch.int8), 2, 9)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        codec.decode(buf, -1, 9)
    with pytest.raises(ValueError, match="x must be a floating"):
        codec.encode(randn(18))
    with pytest.raises(ValueError, match="x must be a floating"):
        codec.encode(torch.ones(2, 9, dtype=torch.int64))


def test_signbit_is_the_signs_alone_and_cannot_carry_non_finite_values():
    """'signbit' (Psyche's messages): pack_signs' bits and nothing else, decoded as +1 / -1,
    zero as +1; its one bit cannot say NaN or inf (the documented exception: a sender checks
    finiteness before it encodes), NaN codes as -1 and inf as its sign."""
    x = torch.tensor([[0.5, -0.0, 0.0, -3.0, 1e-30, -1e-30, 7.0, -2.0, 4.0]])
    buf = get_codec("signbit").encode(x)
    assert buf.tolist() == ref_sign_bytes(x.flatten().tolist())
    assert get_codec("signbit").decode(buf, 1, 9).tolist() == [[1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0]]
    odd = torch.tensor([[float("nan"), float("inf"), -float("inf")]])
    assert get_codec("signbit").roundtrip(odd).tolist() == [[-1.0, 1.0, -1.0]]
