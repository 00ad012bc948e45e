"""Value stages for the EF21 compressors: a flat float vector <-> bytes, sized by its length.

A value stage is the last step of every EF21 compressor (`thinwire.compress.ef21`): a
sparsifier picks what to send, the value stage decides in what precision. The stages are
the value formats of `thinwire.wire.VALUE_FORMATS`, all of them; every one but 'natural' is
that format's `thinwire.wire` codec over the whole vector as one row (one scale):

    fp32     4 bytes/value, lossless
    bf16     2 bytes/value, round to nearest even   ||Q(v) - v||^2 <= 2^-16 ||v||^2
    fp16     2 bytes/value (saturates at +-65504)    ||Q(v) - v||^2 <= 2^-22 ||v||^2 (normal range)
    int8     4-byte absmax scale + 1 byte/value       no general relative bound
    sign     4-byte mean|v| scale + 1 bit/value       no bound better than 1 - 1/n
    2bit     16 bytes of 4 levels + 2 bits/value      no general relative bound (SparseLoCo's
             statistical quantizer: each value decoded as the mean of its bin, `thinwire.wire.twobit`)
    natural  natural compression (Horvath et al. 2019): 1 sign bit + the 8-bit float32
             exponent, i.e. |v| rounded *stochastically* to one of its two neighbouring powers
             of two, unbiased:  E[Q(v)] = v,  E||Q(v) - v||^2 <= (1/8) ||v||^2.
             Wire: packed_nbytes(n, 1) bytes of signs (`pack_signs`), then n exponent bytes.

`error_factor` is the constant eps with (E)||Q(v) - v||^2 <= eps ||v||^2, or None when no
such bound holds (the table's `ValueFormat.error_factor`); the compressors use it for their
contraction parameter alpha.
"""

from __future__ import annotations

import torch

from ..wire import VALUE_FORMATS, get_codec, pack_signs, packed_nbytes, unpack_signs

# every value format but 'signbit', whose ±1 keeps no magnitude: an EF21 compressor must be contractive
VALUE_STAGES: tuple[str, ...] = tuple(name for name in VALUE_FORMATS if name != "signbit")
_MANTISSA = 1 << 23


def generator(seed: int) -> torch.Generator:
    """A CPU generator every rank can rebuild from the same integer seed."""
    return torch.Generator(device="cpu").manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)


class CodecStage:
    """A `thinwire.wire` value codec applied to the whole vector as one row (one scale)."""

    def __init__(self, name: str):
        self.name, self.codec = name, get_codec(name)
        self.lossless = VALUE_FORMATS[name].lossless
        self.error_factor = VALUE_FORMATS[name].error_factor

    def nbytes(self, n: int) -> int:
        return self.codec.nbytes(1, n)

    def encode(self, v: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        self.codec.encode(v.reshape(1, -1), out=out)

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return self.codec.decode(buf, 1, n).view(n)


class NaturalCodec:
    """Natural compression: v -> sign(v) 2^floor(log2|v|) or sign(v) 2^(floor(log2|v|)+1),
    the larger with probability (|v| - 2^e) / 2^e, drawn from `seed`.

    Works on the float32 bit pattern: the exponent field rounds up by one when a uniform
    23-bit integer is below the mantissa field, which is exactly that probability; for
    subnormals (exponent field 0) the two neighbours are 0 and 2^-126 and the same rule is
    unbiased too. NaN and inf keep exponent field 255 and decode as inf, so receivers see a
    non-finite value; a value within one binade of the float32 maximum may round up to inf.
    """

    name = "natural"
    lossless, error_factor = VALUE_FORMATS[name].lossless, VALUE_FORMATS[name].error_factor

    def nbytes(self, n: int) -> int:
        return packed_nbytes(n, 1) + n

    def encode(self, v: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        v = v.reshape(-1).float().contiguous()
        bits = v.view(torch.int32)
        exponent = (bits >> 23) & 0xFF
        draws = torch.randint(0, _MANTISSA, (v.numel(),), generator=generator(seed), dtype=torch.int32)
        up = (draws.to(v.device) < (bits & (_MANTISSA - 1))) & (exponent < 255)
        signs = packed_nbytes(v.numel(), 1)
        pack_signs(v, out=out[:signs])
        out[signs:].copy_(exponent.add_(up.to(torch.int32)).to(torch.uint8))

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.nbytes(n):
            raise ValueError(f"malformed natural values: expected {self.nbytes(n)} bytes for {n} values, "
                             f"got {buf.dtype} of shape {tuple(buf.shape)}")
        signs = packed_nbytes(n, 1)
        magnitude = (buf[signs:].to(torch.int32) << 23).view(torch.float32)   # 0 -> 0.0, 255 -> inf
        return magnitude.mul_(unpack_signs(buf[:signs], n))


def get_value_stage(name: str):
    """The value stage called `name` (one of VALUE_STAGES)."""
    if name not in VALUE_STAGES:
        raise ValueError(f"value stage must be one of {VALUE_STAGES}, got {name!r}")
    return CodecStage(name) if VALUE_FORMATS[name].codec else NaturalCodec()
