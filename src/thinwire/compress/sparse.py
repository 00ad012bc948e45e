"""Sparsifying EF21 compressors: Top-K and Rand-K of the flattened tensor.

Both keep K = max(1, round(ratio * d)) of the d entries and send them through a value stage
(`thinwire.compress.value_stages`); the base class, the contraction bound and the interface
are in `thinwire.compress.ef21`. These are the per-tensor forms, the reference for the wire
format; EF21-Muon runs the same compressors over all its tensors at once, in the same bytes
(`thinwire.compress.ef21_blocks`). Nothing here is data-dependent in size: a bitmap's
positions come from a sort or a top-k, never `nonzero`, and Rand-K draws its positions on
the tensor's device (`device_generator`). `decode` checks what it reads on the host (a
malformed payload raises ValueError); the block form checks on the device.
"""

from __future__ import annotations

import torch

from ..ops.select import largest_indices
from ..wire import index_width, pack_bits, packed_nbytes, unpack_bits
from .ef21 import EF21Compressor, check_ratio, numel
from .ef21_rows import device_generator


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
        n = numel(shape)
        return min(n, max(1, round(self.ratio * n)))

    def alpha(self, shape):
        return self._value_alpha(self.k(shape) / numel(shape))

    def _scatter(self, idx: torch.Tensor, vals: torch.Tensor, shape) -> torch.Tensor:
        dense = torch.zeros(numel(shape), dtype=torch.float32, device=vals.device)
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
        n, k = numel(shape), self.k(shape)
        return packed_nbytes(n, 1) < packed_nbytes(k, index_width(n))

    def _index_nbytes(self, shape) -> int:
        n = numel(shape)
        return packed_nbytes(n, 1) if self.bitmap(shape) else packed_nbytes(self.k(shape), index_width(n))

    def payload_nbytes(self, shape) -> int:
        return self._index_nbytes(shape) + self.values.nbytes(self.k(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        flat, cut = x.reshape(-1), self._index_nbytes(x.shape)
        idx = largest_indices(flat.abs(), self.k(x.shape))
        if self.bitmap(x.shape):
            idx = idx.sort().values                                          # ascending positions
            mask = torch.zeros(flat.numel(), dtype=torch.uint8, device=flat.device).index_fill_(0, idx, 1)
            pack_bits(mask, 1, out=out[:cut])
        else:
            pack_bits(idx, index_width(flat.numel()), out=out[:cut])
        self.values.encode(flat[idx], out[cut:], seed)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        buf = self._buffer(buf, shape)
        n, k, cut = numel(shape), self.k(shape), self._index_nbytes(shape)
        if self.bitmap(shape):
            bits = unpack_bits(buf[:cut], 1, n)
            marked = int(bits.sum())
            if marked != k:
                raise ValueError(f"malformed payload: bitmap marks {marked} positions, expected {k}")
            idx = bits.topk(k).indices.sort().values                         # ascending positions
        else:
            idx = unpack_bits(buf[:cut], index_width(n), k)
            if int(idx.max()) >= n:
                raise ValueError(f"malformed payload: index {int(idx.max())} out of range for {n} values")
        return self._scatter(idx, self.values.decode(buf[cut:], k), shape)


class RandK(_Sparse):
    """K uniformly random entries, *unscaled*, so contractive in expectation with
    alpha = K / d (the scaled d/K version is unbiased but not contractive, which EF21 needs).

    The indices are drawn from `seed` on every rank (no index bytes on the wire): only the
    K values travel. They are drawn on the tensor's device (on the CPU the stream of
    `value_stages.generator(seed)`), so a GPU copies nothing from the host.
    """

    kind = "randk"

    def indices(self, shape, seed: int, device) -> torch.Tensor:
        perm = torch.randperm(numel(shape), generator=device_generator(seed, device), device=device)
        return perm[: self.k(shape)]

    def payload_nbytes(self, shape) -> int:
        return self.values.nbytes(self.k(shape))

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        # the value stage's own randomness (natural rounding) gets a stream apart from the indices
        self.values.encode(x.reshape(-1)[self.indices(x.shape, seed, x.device)], out, seed ^ 0x5BD1E995)

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        vals = self.values.decode(self._buffer(buf, shape), self.k(shape))
        return self._scatter(self.indices(shape, seed, vals.device), vals, shape)
