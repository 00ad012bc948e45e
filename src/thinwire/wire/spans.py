"""Where each of a list of parts lies in one flat buffer: end to end, in order, from 0.

    span_i = [start_i, start_i + size_i),    start_0 = 0,    start_{i+1} = start_i + size_i

A part's size is what it takes in that buffer: a tensor's elements (`views`, a float
buffer of parameters or gradients) or the bytes of its encoded message (`spans` of
payload sizes). `base.flatten_grads` is the same walk and could use `views`.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Sequence

import torch


class Span(NamedTuple):
    """One part's place in a flat buffer: [start, start + size)."""
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This span of `flat`, a view."""
        return flat[self.start: self.stop]


def spans(sizes: Iterable[int]) -> list[Span]:
    """The spans of parts of these sizes, laid end to end in order from offset 0."""
    placed, start = [], 0
    for size in sizes:
        placed.append(Span(start, size))
        start += size
    return placed


def views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each tensor's span of `flat` (sizes: their numel, in order), shaped like the tensor."""
    for t, span in zip(tensors, spans(t.numel() for t in tensors)):
        yield span.of(flat).view(t.shape)


def same_place(view: torch.Tensor, base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The part of `other` (a buffer laid out like `base`) that `view` is of `base`: its shape,
    strides and offset from base's start."""
    return other.as_strided(view.shape, view.stride(),
                            other.storage_offset() + view.storage_offset() - base.storage_offset())


def reuse(buf: torch.Tensor | None, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """`buf` if it is a flat buffer of `numel` elements of `dtype` on `device`, else a new one:
    the buffers kept across steps, made again only when the layout changes."""
    if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != torch.device(device):
        buf = torch.empty(numel, dtype=dtype, device=device)
    return buf
