"""Wire formats: tensors <-> flat uint8 buffers whose sizes follow from shapes alone, so a
receiver can slice a message without any metadata on the wire.

`bits`: unsigned integers of any width 1..32 packed densely (`pack_bits` / `unpack_bits`),
signs and bool flags at 1 bit each (`pack_signs`, `pack_flags` and their inverses). Value i occupies stream bits
[i*width, (i+1)*width), least significant bit first; stream bit j is bit j % 8 of byte
j // 8; the last byte is zero-padded: ceil(count * width / 8) bytes in all.

`indices`: `INDEX_CODINGS`, the codings of a top-k's chunk-local indices: 'packed' (ceil(log2 n)
bits each) and 'elias-fano' (rows ascending, about log2(n / k) + 2 bits each).

`values`: `VALUE_FORMATS`, the one table of value-format names (name -> `ValueFormat`: bits
per value, per-row scale or not, lossless or not, error factor, whether `get_codec` has it;
`CODEC_NAMES` derives from it), and the codecs of a float [rows, cols] tensor, one scale per
row where the codec has one, as
    fp32  rows*cols*4 bytes (lossless)
    bf16  rows*cols*2 bytes
    fp16  rows*cols*2 bytes (finite values saturate at +-65504)
    int8  rows*4 bytes of float32 absmax scales, then rows*cols int8
    sign  rows*4 bytes of float32 scales, then ceil(rows*cols / 8) bytes of sign bits
    2bit  rows*16 bytes of float32 levels, then ceil(rows*cols / 4) bytes of 2-bit codes
          (SparseLoCo's statistical quantizer, `twobit`)
    8bit  rows*1024 bytes of float32 levels, then rows*cols bytes of codes
          (the same with 256 levels, Templar's default, `eightbit`)
The 'natural' format (sign + exponent, stochastically rounded from a seed) is an EF21 value
stage on flat vectors only: `thinwire.compress.value_stages`. All multi-byte numbers are
little-endian.
"""

from .bits import index_width, pack_bits, pack_flags, pack_signs, packed_nbytes, unpack_bits, unpack_flags, unpack_signs
from .indices import INDEX_CODINGS, EliasFanoIndices, PackedIndices, index_coding
from .values import (CODEC_NAMES, FP16_MAX, VALUE_FORMATS, FloatCodec, Int8Codec, SignBitCodec, SignCodec, ValueCodec,
                     ValueFormat, get_codec)
from .twobit import TwoBitCodec
from .eightbit import EightBitCodec

__all__ = [
    "CODEC_NAMES", "EightBitCodec", "FP16_MAX", "FloatCodec", "Int8Codec", "SignBitCodec", "SignCodec", "TwoBitCodec", "VALUE_FORMATS",
    "ValueCodec", "ValueFormat", "get_codec",
    "INDEX_CODINGS", "EliasFanoIndices", "PackedIndices", "index_coding",
    "index_width", "pack_bits", "pack_flags", "pack_signs", "packed_nbytes", "unpack_bits", "unpack_flags",
    "unpack_signs",
]
