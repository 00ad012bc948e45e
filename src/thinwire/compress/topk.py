"""Chunked transform + top-k per chunk: DeMo's compressor, usable on any tensor.

Wire format of one tensor (all sizes derived from its shape, so nothing else is sent):
    indices: num_chunks * k indices, each in ceil(log2(h*w)) bits (`thinwire.wire.pack_bits`)
    values:  num_chunks rows of k values in the chosen codec (fp32, bf16, fp16, int8 or
             sign, with one scale per chunk for the last two)
k = min(topk, h*w). Coefficient order inside a chunk is row-major over (h, w).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..wire import get_codec, index_width, pack_bits, packed_nbytes, unpack_bits
from .chunking import ChunkPlan
from .payload import Payload, PayloadSpec
from .transforms import ChunkTransform

AGGREGATIONS = ("mean", "senders")


class ChunkedTopK:
    """encode(x) keeps the k largest-magnitude transform coefficients of every chunk.

    aggregate() averages what all ranks sent: 'mean' divides the sum by the number of ranks
    (the average of the ranks' decoded tensors); 'senders' divides each coefficient by the
    number of ranks that sent it (bloc97/DeMo's scatter_reduce(mean)). Ranks are summed in
    rank order, one scatter per rank (indices are unique within a rank), so the result is
    bit-identical on every rank and device.
    """

    def __init__(self, topk: int = 32, chunk: int = 64, transform: str = "dct", values: str = "bf16",
                 seed: int = 0):
        if int(topk) != topk or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk}")
        if int(chunk) != chunk or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {chunk}")
        self.topk, self.chunk = int(topk), int(chunk)
        self.transform = ChunkTransform(transform, seed)
        self.codec = get_codec(values)
        self._plans: dict[tuple[int, ...], ChunkPlan] = {}

    def plan(self, shape) -> ChunkPlan:
        shape = tuple(shape)
        if shape not in self._plans:
            self._plans[shape] = ChunkPlan.for_shape(shape, self.chunk)
        return self._plans[shape]

    def k(self, shape) -> int:
        return min(self.topk, self.plan(shape).chunk_elems)

    def payload_spec(self, shape) -> PayloadSpec:
        plan, k = self.plan(shape), self.k(shape)
        count = plan.num_chunks * k
        return (("indices", packed_nbytes(count, index_width(plan.chunk_elems))),
                ("values", self.codec.nbytes(plan.num_chunks, k)))

    def payload_nbytes(self, shape) -> int:
        return sum(n for _, n in self.payload_spec(shape))

    def coefficients(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[*shape] -> [num_chunks, h*w] transform coefficients (float32)."""
        plan = self.plan(x.shape)
        return self.transform.forward(plan.padded_matrix(x), plan, step)

    def encode(self, x: torch.Tensor, step: int = 0, out: torch.Tensor | None = None) -> Payload:
        """Top-k coefficients of every chunk of x; written into `out` (flat uint8) if given."""
        return self.encode_coefficients(self.coefficients(x, step), x.shape, out)

    def encode_coefficients(self, coeffs: torch.Tensor, shape, out: torch.Tensor | None = None) -> Payload:
        """Like encode, from coefficients already in the transform domain ([n_chunks, h*w])."""
        spec = self.payload_spec(shape)
        if out is None:
            out = torch.empty(sum(n for _, n in spec), dtype=torch.uint8, device=coeffs.device)
        payload = Payload.from_buffer(out, spec)
        idx = coeffs.abs().topk(self.k(shape), dim=-1, sorted=False).indices       # [n_chunks, k]
        pack_bits(idx, index_width(coeffs.shape[-1]), out=payload.parts["indices"])
        self.codec.encode(coeffs.gather(-1, idx), out=payload.parts["values"])
        return payload

    def read(self, payload: Payload, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [n_chunks, k] int64, values [n_chunks, k] float32), validated."""
        plan, k = self.plan(shape), self.k(shape)
        count, elems = plan.num_chunks * k, plan.chunk_elems
        idx = unpack_bits(payload.parts["indices"], index_width(elems), count).view(plan.num_chunks, k)
        if count and int(idx.max()) >= elems:
            raise ValueError(f"malformed payload: index {int(idx.max())} out of range for a chunk of {elems}")
        vals = self.codec.decode(payload.parts["values"], plan.num_chunks, k)
        if not bool(torch.isfinite(vals).all()):
            raise ValueError("malformed payload: non-finite values")
        return idx, vals

    def decode(self, payload: Payload, shape, step: int = 0) -> torch.Tensor:
        """The dense tensor (float32, `shape`) a receiver reconstructs from one payload."""
        plan = self.plan(shape)
        return plan.from_chunks(self.transform.sparse_inverse(*self.read(payload, shape), plan, step))

    def subtract_decoded(self, target: torch.Tensor, read: tuple[torch.Tensor, torch.Tensor], alpha: float,
                         step: int = 0) -> None:
        """target -= alpha * decode(payload), in place, from a payload's `read()` output."""
        plan = self.plan(target.shape)
        chunks = self.transform.sparse_inverse(*read, plan, step).to(target.dtype)   # [gr, gc, h, w]
        if plan.padded or not target.is_contiguous():
            target.sub_(plan.from_chunks(chunks), alpha=alpha)
        else:  # subtract through a chunk-shaped view of target: no reordering copy
            plan.chunk_view(target.view(plan.rows, plan.cols)).sub_(chunks, alpha=alpha)

    def aggregate(self, reads: Sequence[tuple[torch.Tensor, torch.Tensor]], shape, step: int = 0,
                  mode: str = "mean") -> torch.Tensor:
        """Average of the ranks' decoded tensors, from their payloads' `read()` outputs
        (see the class docstring for `mode`)."""
        if mode not in AGGREGATIONS:
            raise ValueError(f"mode must be one of {AGGREGATIONS}, got {mode!r}")
        plan = self.plan(shape)
        sent = len(reads) * reads[0][0].shape[1]                    # coefficients per chunk, all ranks
        if mode == "mean" and sent < plan.chunk_rows + plan.chunk_cols:
            # Σ_r Σ_j (c_rj / W) outer(P_h[u_rj], P_w[v_rj]): h·w·W·k multiply-adds per chunk
            # instead of the dense inverse's h·w·(h + w), and no dense zero-fill and scatter
            idx = torch.cat([i for i, _ in reads], dim=1)           # [n_chunks, W*k], rank order
            vals = torch.cat([v for _, v in reads], dim=1).div_(len(reads))
            return plan.from_chunks(self.transform.sparse_inverse(idx, vals, plan, step))
        dense = torch.zeros(plan.num_chunks, plan.chunk_elems, device=reads[0][1].device)  # [n_chunks, h*w]
        counts = torch.zeros_like(dense) if mode == "senders" else None
        for idx, vals in reads:  # rank order: a fixed summation order on every rank
            dense.scatter_add_(1, idx, vals)
            if counts is not None:
                counts.scatter_add_(1, idx, torch.ones_like(vals))
        dense.div_(len(reads) if counts is None else counts.clamp_(min=1))
        return plan.crop(self.transform.inverse(dense, plan, step))
