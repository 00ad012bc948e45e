"""Compressor spec strings ('topk:0.05+natural') and DeMo's chunked-DCT top-k as an EF21 compressor.

Grammar:  <base>[+<values>]
    base    identity | natural | topk:<ratio> | randk:<ratio> | rank:<K> | dct-topk:<k>[:<chunk>]
    values  fp32 (default) | bf16 | fp16 | int8 | sign | natural       (thinwire.compress.natural)
<ratio> is in (0, 1]; <K>, <k> and <chunk> are integers >= 1; 'natural' alone is
'identity+natural'. dct-topk takes the value formats of ChunkedTopK (not natural), one
scale per chunk for int8 and sign.
"""

from __future__ import annotations

from ..wire import CODEC_NAMES
from .lowrank import RankK
from .natural import VALUE_STAGES
from .payload import Payload
from .sparse import EF21Compressor, Identity, RandK, TopK, check_count, check_ratio
from .topk import ChunkedTopK

COMPRESSOR_NAMES = ("identity", "natural", "topk", "randk", "rank", "dct-topk")


class DctTopK(EF21Compressor):
    """DeMo's chunked-DCT top-k (`ChunkedTopK`, transform='dct'): the k largest orthonormal
    DCT-II coefficients of every chunk (64 x 64 by default), indices bit-packed.

    The DCT is orthonormal, so per chunk ||x - C(x)||^2 <= (1 - k / chunk_elems) ||x||^2
    (zero padding adds no energy): alpha = min(1, k / chunk_elems) for the plan's chunk size,
    times (1 - eps) of the value format (fp32, bf16, fp16; None for int8 and sign).
    """

    kind = "dct-topk"
    _EPS = {"fp32": 0.0, "bf16": 2.0 ** -16, "fp16": 2.0 ** -22}

    def __init__(self, topk: int = 32, chunk: int = 64, values: str = "fp32"):
        topk, chunk = check_count(topk, "dct-topk k"), check_count(chunk, "dct-topk chunk")
        if values not in CODEC_NAMES:
            raise ValueError(f"dct-topk values must be one of {CODEC_NAMES}, got {values!r}")
        self.inner = ChunkedTopK(topk, chunk, "dct", values)
        self.value_format = values

    @classmethod
    def wrap(cls, inner: ChunkedTopK) -> "DctTopK":
        if inner.transform.kind != "dct":
            raise ValueError("only a ChunkedTopK with transform='dct' can serve as an EF21 compressor")
        self = cls.__new__(cls)
        self.inner, self.value_format = inner, inner.codec.name
        return self

    @property
    def name(self) -> str:
        suffix = "" if self.value_format == "fp32" else f"+{self.value_format}"
        return f"dct-topk:{self.inner.topk}:{self.inner.chunk}{suffix}"

    def alpha(self, shape):
        eps = self._EPS.get(self.value_format)
        return None if eps is None else min(1.0, self.inner.topk / self.inner.plan(shape).chunk_elems) * (1 - eps)

    def payload_nbytes(self, shape) -> int:
        return self.inner.payload_nbytes(tuple(shape))

    def encode(self, x, out, seed: int = 0) -> None:
        self.inner.encode(x, 0, out=out)

    def decode(self, buf, shape, seed: int = 0):
        shape = tuple(shape)
        return self.inner.decode(Payload.from_buffer(buf, self.inner.payload_spec(shape)), shape)


def _number(kind, name: str, text: str):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name} needs {'a ratio' if kind is float else 'an integer'}, got {text!r}") from None


def _build(name: str, arg: str, values: str) -> EF21Compressor:
    if name in ("identity", "natural") and arg:
        raise ValueError(f"{name} takes no argument, got {arg!r}")
    if name == "identity":
        return Identity(values)
    if name == "natural":
        if values != "fp32":
            raise ValueError("natural is itself a value stage; it cannot be followed by another")
        return Identity("natural")
    if name in ("topk", "randk"):
        return (TopK if name == "topk" else RandK)(check_ratio(_number(float, name, arg)), values)
    if name == "rank":
        return RankK(check_count(_number(int, name, arg), "rank K"), values)
    k, _, chunk = arg.partition(":")
    return DctTopK(check_count(_number(int, name, k), "dct-topk k"),
                   check_count(_number(int, name, chunk or "64"), "dct-topk chunk"), values)


def parse_compressor(spec, argument: str = "compressor") -> EF21Compressor:
    """An EF21 compressor from a spec string or object; ValueError naming `argument` otherwise."""
    if isinstance(spec, EF21Compressor):
        return spec
    try:
        if isinstance(spec, ChunkedTopK):
            return DctTopK.wrap(spec)
        if not isinstance(spec, str):
            raise ValueError(f"expected a compressor or a spec string, got {type(spec).__name__}")
        base, *stages = spec.strip().split("+")
        if len(stages) > 1:
            raise ValueError("at most one value stage may follow the base compressor")
        values = stages[0] if stages else "fp32"
        if values not in VALUE_STAGES:
            raise ValueError(f"unknown value stage {values!r}; one of {VALUE_STAGES}")
        name, _, arg = base.partition(":")
        if name not in COMPRESSOR_NAMES:
            raise ValueError(f"unknown compressor {name!r}; one of {COMPRESSOR_NAMES}")
        return _build(name, arg, values)
    except ValueError as err:
        raise ValueError(f"{argument}={spec!r}: {err}") from None
