"""Contractive compressors for EF21 messages: identity, Top-K and Rand-K.

Every compressor C maps a tensor to bytes whose count follows from the shape alone, and
satisfies  E||C(x) - x||^2 <= (1 - alpha) ||x||^2  with the `alpha(shape)` it documents
(None where no bound is known). A compressor is a sparsifier followed by a value stage
(`thinwire.compress.natural`): 'topk:0.05+natural' keeps the top 5 % and sends each kept
value as sign + exponent. When the value stage has error factor eps (eps = 0 for fp32),
the kept part's error is orthogonal to the dropped part, so

    E||C(x) - x||^2 = ||x||^2 - E||S(x)||^2 + E||Q(S(x)) - S(x)||^2 <= (1 - (1 - eps) alpha_S) ||x||^2.

Interface (what EF21Muon uses): `name` (the canonical spec), `lossless`,
`payload_nbytes(shape)`, `encode(x, out, seed)` writing exactly that many bytes into `out`,
`decode(buf, shape, seed)` -> float32 tensor of `shape` (validated: indices in range, values
finite; raises ValueError otherwise), `alpha(shape)`. `seed` feeds the compressor's
randomness (Rand-K indices, natural rounding); sender and receivers pass the same seed.
"""

from __future__ import annotations

import math

import torch

from ..ops.select import largest_indices
from ..wire import index_width, pack_bits, packed_nbytes, unpack_bits
from .natural import generator, get_value_stage


def _numel(shape) -> int:
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
    """Base class: a value stage (`values`, default fp32) applied to what `_select` keeps."""

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

    def _value_alpha(self, alpha):
        eps = self.values.error_factor
        return None if alpha is None or eps is None else alpha * (1.0 - eps)

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
        return self.values.nbytes(_numel(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        self.values.encode(x.reshape(-1), out, seed)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        return self._finite(self.values.decode(buf, _numel(shape)).view(tuple(shape)))


class _Sparse(EF21Compressor):
    """K = max(1, round(ratio * d)) coordinates of the flattened tensor (d elements)."""

    def __init__(self, ratio: float, values: str = "fp32"):
        super().__init__(values)
        self.ratio = check_ratio(ratio)

    @property
    def name(self) -> str:
        suffix = "" if self.values.name == "fp32" else f"+{self.values.name}"
        return f"{self.kind}:{self.ratio:g}{suffix}"

    def k(self, shape) -> int:
        n = _numel(shape)
        return min(n, max(1, round(self.ratio * n)))

    def alpha(self, shape):
        return self._value_alpha(self.k(shape) / _numel(shape))

    def _scatter(self, idx: torch.Tensor, vals: torch.Tensor, shape) -> torch.Tensor:
        dense = torch.zeros(_numel(shape), dtype=torch.float32, device=vals.device)
        return dense.index_put_((idx,), self._finite(vals)).view(tuple(shape))


class TopK(_Sparse):
    """The K largest-magnitude entries; contractive, alpha = K / d (deterministic bound).

    Wire: where the K entries sit, then their K values in the value stage. The positions
    take whichever form is smaller for (K, d), known to both sides from the shape: K
    indices of index_width(d) bits each (`pack_bits`, values in topk's order), or a d-bit
    bitmap (values in ascending position order), which wins once K / d exceeds about
    1 / index_width(d) (top 15 % of a 256 x 1024 matrix: 0.125 bytes per element instead
    of 0.34).
    """

    kind = "topk"

    def bitmap(self, shape) -> bool:
        """Whether the positions travel as a bitmap (see the class docstring)."""
        n, k = _numel(shape), self.k(shape)
        return packed_nbytes(n, 1) < packed_nbytes(k, index_width(n))

    def _index_nbytes(self, shape) -> int:
        n = _numel(shape)
        return packed_nbytes(n, 1) if self.bitmap(shape) else packed_nbytes(self.k(shape), index_width(n))

    def payload_nbytes(self, shape) -> int:
        return self._index_nbytes(shape) + self.values.nbytes(self.k(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        flat, cut = x.reshape(-1), self._index_nbytes(x.shape)
        idx = largest_indices(flat.abs(), self.k(x.shape))
        if self.bitmap(x.shape):
            mask = torch.zeros(flat.numel(), dtype=torch.uint8, device=flat.device).index_fill_(0, idx, 1)
            pack_bits(mask, 1, out=out[:cut])
            idx = mask.nonzero().view(-1)                                # ascending positions
        else:
            pack_bits(idx, index_width(flat.numel()), out=out[:cut])
        self.values.encode(flat[idx], out[cut:], seed)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        n, k, cut = _numel(shape), self.k(shape), self._index_nbytes(shape)
        if self.bitmap(shape):
            idx = unpack_bits(buf[:cut], 1, n).nonzero().view(-1)
            if idx.numel() != k:
                raise ValueError(f"malformed payload: bitmap marks {idx.numel()} positions, expected {k}")
        else:
            idx = unpack_bits(buf[:cut], index_width(n), k)
            if int(idx.max()) >= n:
                raise ValueError(f"malformed payload: index {int(idx.max())} out of range for {n} values")
        return self._scatter(idx, self.values.decode(buf[cut:], k), shape)


class RandK(_Sparse):
    """K uniformly random entries, *unscaled*, so contractive in expectation with
    alpha = K / d (the scaled d/K version is unbiased but not contractive, which EF21 needs).

    The indices are drawn from `seed` on every rank (no index bytes on the wire): only the
    K values travel.
    """

    kind = "randk"

    def indices(self, shape, seed: int, device) -> torch.Tensor:
        perm = torch.randperm(_numel(shape), generator=generator(seed))
        return perm[: self.k(shape)].to(device)

    def payload_nbytes(self, shape) -> int:
        return self.values.nbytes(self.k(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        # the value stage's own randomness (natural rounding) gets a stream apart from the indices
        self.values.encode(x.reshape(-1)[self.indices(x.shape, seed, x.device)], out, seed ^ 0x5BD1E995)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        vals = self.values.decode(buf, self.k(shape))
        return self._scatter(self.indices(shape, seed, vals.device), vals, shape)
