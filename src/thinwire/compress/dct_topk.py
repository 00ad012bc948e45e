"""DeMo's chunked-DCT top-k (`thinwire.compress.topk.ChunkedTopK`) as an EF21 compressor,
spec 'dct-topk:<k>[:<chunk>][+<values>]' (`thinwire.compress.spec`).

The wire format is ChunkedTopK's: bit-packed chunk-local indices, then the values in one of
the `thinwire.wire` codecs (not 'natural'), one scale per chunk for int8 and sign.
"""

from __future__ import annotations

import torch

from ..wire import CODEC_NAMES, VALUE_FORMATS
from .ef21 import EF21Compressor, check_count
from .topk import ChunkedTopK


class DctTopK(EF21Compressor):
    """DeMo's chunked-DCT top-k (`ChunkedTopK`, transform='dct'): the k largest orthonormal
    DCT-II coefficients of every chunk (64 x 64 by default), indices bit-packed.

    The DCT is orthonormal, so per chunk ||x - C(x)||^2 <= (1 - k / chunk_elems) ||x||^2
    (zero padding adds no energy): alpha = min(1, k / chunk_elems) for the plan's chunk size,
    times (1 - eps) of the value format (fp32, bf16, fp16; None for int8 and sign).
    """

    kind = "dct-topk"

    def __init__(self, topk: int = 32, chunk: int = 64, values: str = "fp32"):
        topk, chunk = check_count(topk, "dct-topk k"), check_count(chunk, "dct-topk chunk")
        if values not in CODEC_NAMES or values == "signbit":          # ±1 keeps no magnitude: not contractive
            raise ValueError(f"dct-topk values must be one of {tuple(n for n in CODEC_NAMES if n != 'signbit')}, "
                             f"got {values!r}")
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
        eps = VALUE_FORMATS[self.value_format].error_factor
        return None if eps is None else min(1.0, self.inner.topk / self.inner.plan(shape).chunk_elems) * (1 - eps)

    def payload_nbytes(self, shape) -> int:
        return self.inner.payload_nbytes(tuple(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        self.inner.encode(x, out, seed)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        return self.inner.decode(buf, shape, seed)
