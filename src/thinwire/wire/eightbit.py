"""The '8bit' value format: Templar's statistical quantizer with 256 levels per row, the default
of its `TopKCompressor` (tplr-ai/templar, src/tplr/compress.py, `_quantize_values` /
`_dequantize_values`: quantization_bins=256, quantization_range=6). It is the '2bit'
quantizer (`thinwire.wire.twobit`) with L = 256 levels and 1-byte codes.

For one row of n values x (any float dtype; statistics in float64), R = 6, L = 256:

    μ = mean(x)                                   Templar's shift
    σ = sqrt(Σ (x − μ)² / (n − 1))                its std: ||x − μ|| / sqrt(n − 1)
    s = R σ / L                                   its scale: 6 sigmas over 256 bins;
                                                  s = 1 where that is 0 or not finite (n = 1 too)
    q = clamp(round((x − μ) / s + L/2), 0, L−1)   the code, one byte (offset 128, round half
                                                  to even): bins s wide, code 128 centred on μ,
                                                  codes 0 and 255 also take the tails beyond
                                                  μ − 127.5 s and μ + 126.5 s (about ±3σ)
    t_b = mean of the x with q = b                the level of code b (μ when no value has it),
                                                  rounded once to float32
    decode: x̂ = t_q

Templar sends its shift μ and a lookup of 256 float32 means of x − μ (0 for an empty bin) and
decodes lookup[q] + μ; this codec sends their sums t_b (256 floats, not 257): the same levels
up to that rounding. What else differs, all of it rounding:
  * Templar computes μ, σ, the codes and the bin sums in the values' dtype (float32 for
    float32 values, atomically added on a GPU: its bin sums vary in the last bit from run to
    run); here in float64 (in element order). On rows centred near 0 a code differs only for
    a value within float32 rounding of a bin edge and a level only in its last bits; on a row
    whose mean is large against its spread (mean 5, spread 1e-4: a bin is 5 ulps of 5.0)
    Templar's float32 shift moves codes by one and its levels lookup + μ round to an ulp of
    μ, up to about a bin apart from the bin means this codec sends (tests/wire/test_eightbit.py).
  * a row holding NaN or inf gets NaN levels, so it decodes non-finite (Templar's output is
    undefined there: a NaN cast to uint8).
Templar quantizes the kept values of a whole tensor together (one μ, σ and lookup per tensor);
`SparseLoCoTopK` gives this codec a tensor's kept values as one row, as it does '2bit'.

Layout of a [rows, cols] tensor: rows × 256 float32 levels t (row-major), then rows·cols
bytes of codes q, row-major: 1024·rows + rows·cols bytes, so 1 + 1024 / cols bytes a value.
"""

from __future__ import annotations

from .twobit import StatisticalCodec

LEVELS = 256            # 8 bits: Templar's quantization_bins
BITS = 8


class EightBitCodec(StatisticalCodec):
    """'8bit': 256 float32 levels per row, then one byte per value (the module docstring)."""

    name, levels, bits = "8bit", LEVELS, BITS
