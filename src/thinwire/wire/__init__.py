"""Wire formats: tensors <-> flat uint8 buffers.

`bits` packs unsigned integers of any width 1..32 (and signs, 1 bit each) densely into
bytes; `values` codes float values as fp32, bf16, fp16, int8 with a per-row scale, or a
1-bit sign with a per-row scale. Every size is a function of the shape alone, so a
receiver can slice a message without any metadata on the wire.
"""

from .bits import index_width, pack_bits, pack_signs, packed_nbytes, unpack_bits, unpack_signs
from .values import CODEC_NAMES, FloatCodec, Int8Codec, SignCodec, ValueCodec, get_codec

__all__ = ["CODEC_NAMES", "FloatCodec", "Int8Codec", "SignCodec", "ValueCodec", "get_codec", "index_width",
           "pack_bits", "pack_signs", "packed_nbytes", "unpack_bits", "unpack_signs"]
