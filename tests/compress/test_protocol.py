"""One round-trip contract over every compressor, through the `Compressor` protocol only:
DeMo's ChunkedTopK with each transform and value format, and each EF21 spec."""

from __future__ import annotations

import pytest
import torch

from thinwire.compress import TRANSFORMS, ChunkedTopK, Compressor, parse_compressor
from thinwire.wire import CODEC_NAMES, VALUE_FORMATS

SHAPES = [(40, 25), (7, 3, 3, 3), (33,)]
SEED = 7


def chunked(transform: str, values: str, topk: int = 5) -> ChunkedTopK:
    return ChunkedTopK(topk=topk, chunk=8, transform=transform, values=values, seed=3)


# (id, factory, lossless: decode(encode(x)) == x bit for bit)
CASES = [(f"chunked-{t}+{v}", lambda t=t, v=v: chunked(t, v), False) for t in TRANSFORMS for v in CODEC_NAMES]
CASES += [("chunked-identity-all+fp32", lambda: chunked("identity", "fp32", topk=64), True)]
EF21_SPECS = {   # spec -> lossless
    "identity": True, "identity+bf16": False, "identity+int8": False, "natural": False,
    "topk:0.1": False, "topk:0.3": False, "topk:0.1+natural": False, "topk:0.2+sign": False, "topk:0.2+2bit": False,
    "topk:0.2+8bit": False,
    "topk:1": True,
    "randk:0.1": False, "randk:0.2+natural": False, "randk:0.2+fp16": False, "randk:1": True,
    "rank:3": False, "rank:3+bf16": False, "rank:30": True,     # rank 30 >= min(m, n): sent whole
    "dct-topk:16:8": False, "dct-topk:16:8+int8": False, "dct-topk:4:4+sign": False,
}
CASES += [(spec, lambda spec=spec: parse_compressor(spec), lossless) for spec, lossless in EF21_SPECS.items()]


def encode(comp: Compressor, x: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Encode into the middle of a larger buffer pre-filled with `fill`; the guard bytes on
    either side must be left alone."""
    n = comp.payload_nbytes(x.shape)
    big = torch.full((n + 2,), fill, dtype=torch.uint8)
    assert comp.encode(x, big[1: n + 1], SEED) is None
    assert int(big[0]) == fill and int(big[-1]) == fill, "encode wrote outside its payload"
    return big[1: n + 1].clone()


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def case(request):
    _, factory, lossless = request.param
    return factory(), lossless


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_contract(case, shape):
    comp, lossless = case
    assert isinstance(comp, Compressor)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    n = comp.payload_nbytes(shape)
    assert isinstance(n, int) and n > 0
    buf = encode(comp, x)
    # every one of the n bytes is written: the message does not depend on what out held
    assert torch.equal(buf, encode(comp, x, fill=0xFF))
    y = comp.decode(buf, shape, SEED)
    assert y.dtype == torch.float32 and tuple(y.shape) == tuple(shape)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(comp.decode(buf.clone(), list(shape), SEED), y)     # any sequence shape
    if lossless or getattr(comp, "lossless", False):
        assert torch.equal(y, x)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_malformed_payloads_raise(case, shape):
    comp, _ = case
    buf = encode(comp, torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    bad = {
        "truncated": buf[:-1],
        "one byte too many": torch.cat([buf, buf[:1]]),
        "empty": buf[:0],
        "not uint8": buf.view(torch.int8),
        "not flat": buf.view(1, -1),
        # every format can tell: 0xFF... is a NaN/inf value (or scale, or exponent 255), and
        # for most, also an index out of range or a bitmap with too many positions
        "all ones": torch.full_like(buf, 0xFF),
    }
    if comp.codec.name == "signbit" if isinstance(comp, ChunkedTopK) else False:
        # every bit pattern is a sign: all ones is malformed only where it puts an index out of range
        del bad["all ones"]
    for what, b in bad.items():
        with pytest.raises(ValueError, match="malformed|non-finite|out of range|bitmap"):
            comp.decode(b, shape, SEED)
            pytest.fail(f"{what} payload decoded without error")


def test_every_value_format_is_covered():
    """The contract above runs every value format the table lists, on both families."""
    chunked_formats = {name.split("+")[1] for name, _, _ in CASES if name.startswith("chunked-")}
    ef21_formats = {spec.split("+")[1] if "+" in spec else ("natural" if spec == "natural" else "fp32")
                    for spec in EF21_SPECS}
    assert chunked_formats == set(CODEC_NAMES)
    assert ef21_formats == set(VALUE_FORMATS) - {"signbit"}          # refused: below


@pytest.mark.parametrize("spec", ["topk:0.2+signbit", "dct-topk:4:4+signbit"])
def test_ef21_refuses_unscaled_signs(spec):
    """'signbit' (SignDeMo's ±1) keeps no magnitude, so no EF21 compressor can use it."""
    with pytest.raises(ValueError, match="signbit"):
        parse_compressor(spec)
