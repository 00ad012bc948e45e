"""What one rank sends for one tensor: named uint8 buffers whose sizes the receiver knows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PayloadSpec = tuple[tuple[str, int], ...]  # (name, nbytes) in wire order


def check_buffer(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`buf` if it is a 1-D uint8 tensor of exactly `nbytes` bytes; ValueError otherwise."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != nbytes:
        got = f"{buf.dtype} of shape {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise ValueError(f"malformed payload: expected a 1-D uint8 buffer of {nbytes} bytes, got {got}")
    return buf


@dataclass
class Payload:
    """Named uint8 buffers, in wire order. Sizes come from the compressor's `payload_spec`,
    which every rank derives from the tensor shape, so nothing but these bytes is sent."""

    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.parts.values())

    @classmethod
    def from_buffer(cls, buf: torch.Tensor, spec: PayloadSpec) -> "Payload":
        """Split a flat uint8 buffer into the parts of `spec` (writable views, no copy)."""
        check_buffer(buf, sum(n for _, n in spec))
        parts, offset = {}, 0
        for name, n in spec:
            parts[name] = buf[offset: offset + n]
            offset += n
        return cls(parts)
