"""The compressor protocol: what every compressor in `thinwire.compress` offers, so a caller
(an optimizer, a test, a benchmark) can take any of them.

    payload_nbytes(shape) -> int
        the size of the message for a tensor of `shape`, known to every rank from the shape
        alone, so receive buffers are sized before anything is sent;
    encode(x, out, seed) -> None
        writes exactly payload_nbytes(x.shape) bytes into `out`, a contiguous 1-D uint8
        tensor (e.g. a slice of the step's message);
    decode(buf, shape, seed) -> Tensor
        the float32 tensor of `shape` a receiver reconstructs from those bytes; validated:
        ValueError on a buffer of the wrong size or dtype, and on contents the format can
        tell are malformed (an index out of range, a bitmap with the wrong count, a
        non-finite value).

`seed` is the message's shared randomness; sender and receivers pass the same integer.
It draws Rand-K's indices and natural rounding for the EF21 compressors, and it is the step
that picks DeMo's random transform for `ChunkedTopK`; deterministic compressors ignore it.

Implemented by `ChunkedTopK` (DeMo) and every EF21 compressor (`Identity`, `TopK`, `RandK`,
`RankK`, `DctTopK`, i.e. whatever `parse_compressor` returns).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Compressor(Protocol):
    """A tensor <-> bytes compressor; see the module docstring for the contract."""

    def payload_nbytes(self, shape: Sequence[int]) -> int: ...

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None: ...

    def decode(self, buf: torch.Tensor, shape: Sequence[int], seed: int = 0) -> torch.Tensor: ...
