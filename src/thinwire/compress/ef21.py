"""Contractive compressors for EF21 messages: the base class, and the identity.

Every EF21 compressor C maps a tensor to bytes whose count follows from the shape alone, and
satisfies  E||C(x) - x||^2 <= (1 - alpha) ||x||^2  with the `alpha(shape)` it documents
(None where no bound is known). A compressor is a selection (everything: `Identity`; Top-K
or Rand-K: `thinwire.compress.sparse`; rank-K factors: `thinwire.compress.lowrank`; DeMo's
chunked DCT top-k: `thinwire.compress.dct_topk`) followed by a value stage
(`thinwire.compress.value_stages`): 'topk:0.05+natural' keeps the top 5 % and sends each
kept value as sign + exponent. When the value stage has error factor eps (eps = 0 for fp32),
the kept part's error is orthogonal to the dropped part, so

    E||C(x) - x||^2 = ||x||^2 - E||S(x)||^2 + E||Q(S(x)) - S(x)||^2 <= (1 - (1 - eps) alpha_S) ||x||^2.

Interface: the compressor protocol (`thinwire.compress.protocol.Compressor`:
`payload_nbytes(shape)`, `encode(x, out, seed)`, `decode(buf, shape, seed)`), plus `name`
(the canonical spec string, `thinwire.compress.spec`), `lossless` and `alpha(shape)`.
`seed` feeds the compressor's randomness (Rand-K indices, natural rounding); sender and
receivers pass the same seed.

These are the per-tensor forms: `decode` checks what it read on the host (ValueError for a
malformed payload: a host read per call). EF21-Muon runs Identity, Top-K and Rand-K with a
float or natural value stage over all its tensors at once, in the same bytes, with the checks
on the device and the draws on the tensors' device (`thinwire.compress.ef21_blocks`); the
other compressors run tensor by tensor through these.
"""

from __future__ import annotations

import math

import torch

from .payload import check_buffer
from .value_stages import get_value_stage


def numel(shape) -> int:
    return math.prod(tuple(shape))


def check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"compression ratio must be in (0, 1], got {ratio!r}")
    return float(ratio)


def check_count(k, what: str = "K") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {k!r}")
    return k


class EF21Compressor:
    """Base class: a value stage (`values`, default fp32) applied to what the subclass keeps."""

    kind = ""

    def __init__(self, values: str = "fp32"):
        self.values = get_value_stage(values)

    @property
    def name(self) -> str:
        suffix = "" if self.values.name == "fp32" else f"+{self.values.name}"
        return f"{self.kind}{suffix}"

    @property
    def lossless(self) -> bool:
        return False

    def payload_nbytes(self, shape) -> int:
        raise NotImplementedError

    def _value_alpha(self, alpha):
        eps = self.values.error_factor
        return None if alpha is None or eps is None else alpha * (1.0 - eps)

    def _buffer(self, buf: torch.Tensor, shape) -> torch.Tensor:
        """`buf`, checked to be the 1-D uint8 payload of `shape` (ValueError otherwise)."""
        return check_buffer(buf, self.payload_nbytes(shape))

    @staticmethod
    def _finite(x: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(x).all()):
            raise ValueError("malformed payload: non-finite values")
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Identity(EF21Compressor):
    """Every value, in the value stage's precision. alpha = 1 - eps (1 for fp32: lossless)."""

    kind = "identity"

    @property
    def name(self) -> str:
        return "natural" if self.values.name == "natural" else super().name

    @property
    def lossless(self) -> bool:
        return self.values.lossless

    def alpha(self, shape):
        return self._value_alpha(1.0)

    def payload_nbytes(self, shape) -> int:
        return self.values.nbytes(numel(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        self.values.encode(x.reshape(-1), out, seed)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        buf = self._buffer(buf, shape)
        return self._finite(self.values.decode(buf, numel(shape)).view(tuple(shape)))
