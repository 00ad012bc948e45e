"""Chunked transform + top-k per chunk: DeMo's compressor, usable on any tensor.

Wire format of one tensor (all sizes derived from its shape, so nothing else is sent):
    indices: num_chunks * k indices, each in ceil(log2(h*w)) bits (`thinwire.wire.pack_bits`);
             with indices='elias-fano' each chunk's in ascending order, about log2(h*w / k) + 2
             bits each (`thinwire.wire.indices`), and the values in that order
    values:  num_chunks rows of k values in the chosen codec (fp32, bf16, fp16, int8 or
             sign, with one scale per chunk for the last two)
k = min(topk, h*w). Chunks are in row-major order over the chunk grid, and a coefficient's
index inside its chunk is row-major over (h, w).

Internally the coefficients live in image layout (`ChunkTransform.forward_image`): a
[padded_rows, padded_cols] matrix, coefficient (u, v) of chunk (a, b) at [a*h+u, b*w+v].
The methods taking `scratch` write their full-size intermediates there (a flat float32
buffer of at least `plan.padded_numel` elements) instead of allocating.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops.select import ascending
from ..wire import checks, get_codec, index_coding
from ..wire.indices import PackedIndices, check_index_coding
from .chunk_bands import Bands
from .chunking import ChunkPlan
from .payload import Payload, PayloadSpec, check_buffer
from .transforms import ChunkTransform

AGGREGATIONS = ("mean", "senders")
MALFORMED = "malformed payload: an index out of range or non-finite values"


def raise_malformed(status: torch.Tensor | None, what: str = "") -> None:
    """The one host read of a step's arrival status (`read_flagged`'s flags folded by
    `thinwire.wire.checks.any_of`): ValueError when any payload was malformed."""
    if status is not None and bool(status):
        raise ValueError(f"{MALFORMED}{what}")

Read = tuple[torch.Tensor, torch.Tensor]   # (indices [n_chunks, k] int64, values [n_chunks, k] float32)


class ChunkedTopK:
    """encode(x, out, step) keeps the k largest-magnitude transform coefficients of every
    chunk (the compressor protocol, `thinwire.compress.protocol`; DeMo itself calls the
    steps one by one: select, write, read, scatter, aggregate).

    aggregate() averages what all ranks sent: 'mean' divides the sum by the number of ranks
    (the average of the ranks' decoded tensors); 'senders' divides each coefficient by the
    number of ranks that sent it (bloc97/DeMo's scatter_reduce(mean)). Ranks are summed in
    rank order, one scatter per rank (indices are unique within a rank, so no two writes of
    one scatter meet), so the result is bit-identical on every rank and device.
    """

    def __init__(self, topk: int = 32, chunk: int = 64, transform: str = "dct", values: str = "bf16",
                 seed: int = 0, indices: str = "packed"):
        if int(topk) != topk or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk}")
        if int(chunk) != chunk or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {chunk}")
        self.topk, self.chunk = int(topk), int(chunk)
        self.transform = ChunkTransform(transform, seed)
        self.codec = get_codec(values)
        self.indices = check_index_coding(indices)
        self._codings: dict[tuple[int, int], PackedIndices] = {}
        self._plans: dict[tuple[int, ...], ChunkPlan] = {}
        self._bands: dict[tuple, Bands] = {}

    def plan(self, shape) -> ChunkPlan:
        shape = tuple(shape)
        if shape not in self._plans:
            self._plans[shape] = ChunkPlan.for_shape(shape, self.chunk)
        return self._plans[shape]

    def k(self, shape) -> int:
        return min(self.topk, self.plan(shape).chunk_elems)

    def coding(self, shape) -> PackedIndices:
        """The coding of this shape's chunk-local indices (k of the chunk's E per chunk)."""
        key = (self.k(shape), self.plan(shape).chunk_elems)
        if key not in self._codings:
            self._codings[key] = index_coding(self.indices, *key)
        return self._codings[key]

    def payload_spec(self, shape) -> PayloadSpec:
        plan, k = self.plan(shape), self.k(shape)
        return (("indices", self.coding(shape).nbytes(plan.num_chunks)),
                ("values", self.codec.nbytes(plan.num_chunks, k)))

    def payload_nbytes(self, shape) -> int:
        return sum(n for _, n in self.payload_spec(shape))

    # --- image layout ---------------------------------------------------------------------

    def bands(self, plan: ChunkPlan, device) -> Bands:
        """The image a `plan` lays out as one band (`thinwire.compress.chunk_bands`), made once
        per plan and device: its position tables are built then."""
        key = (plan.padded_rows, plan.padded_cols, plan.chunk_rows, plan.chunk_cols, torch.device(device))
        if key not in self._bands:
            self._bands[key] = Bands([(plan.padded_rows, plan.padded_cols)], plan.chunk_rows, plan.chunk_cols, device)
        return self._bands[key]

    def positions(self, plan: ChunkPlan, idx: torch.Tensor) -> torch.Tensor:
        """Chunk-local indices [n_chunks, k] -> flat positions in the image [R*C], int64."""
        return self.bands(plan, idx.device).positions(idx)              # two launches whatever the shape

    def select(self, image: torch.Tensor, shape, scratch: torch.Tensor | None = None) -> Read:
        """The k largest-magnitude coefficients of every chunk of an image [R, C]:
        (chunk-local indices [n_chunks, k], their values [n_chunks, k])."""
        idx, _, values = self.select_at(image, shape, scratch)
        return idx, values

    def select_at(self, image: torch.Tensor, shape, scratch: torch.Tensor | None = None):
        """`select`, with the kept coefficients' flat positions in the image between:
        (indices [n_chunks, k], positions [n_chunks, k] int64, values [n_chunks, k])."""
        return self.select_in(image, self.plan(shape), self.k(shape), scratch)

    def select_in(self, image: torch.Tensor, plan: ChunkPlan, k: int, scratch: torch.Tensor | None = None):
        """`select_at` on an image laid out by `plan` (a tensor's, or a group's stacked images)."""
        bands, flat = self.bands(plan, image.device), image.view(-1)
        if scratch is None:
            scratch = torch.empty(plan.padded_numel, device=image.device)
        idx = bands.largest(flat, k, scratch)
        if self.indices == "elias-fano":                                  # the coding that sends rows sorted
            idx = ascending(idx, plan.chunk_elems)                       # each chunk's ascending, as the coding sends them
        positions = bands.positions(idx)
        return idx, positions, torch.take(image, positions)              # image.view(-1)[positions], 5x faster on CPU

    def write(self, read: Read, shape, out: torch.Tensor | None = None) -> Payload:
        """Pack (indices, values) into the wire format; into `out` (flat uint8) if given."""
        spec = self.payload_spec(shape)
        if out is None:
            out = torch.empty(sum(n for _, n in spec), dtype=torch.uint8, device=read[1].device)
        payload = Payload.from_buffer(out, spec)
        self.coding(shape).pack(read[0], out=payload.parts["indices"])
        self.codec.encode(read[1], out=payload.parts["values"])
        return payload

    def scatter(self, image: torch.Tensor, read: Read, shape, alpha: float = 1.0) -> torch.Tensor:
        """image += alpha * (the coefficients of `read`), in place; indices within one read
        are unique, so no two writes meet and the result does not depend on scheduling."""
        pos = self.positions(self.plan(shape), read[0]).view(-1)
        return image.view(-1).index_add_(0, pos, read[1].reshape(-1), alpha=alpha).view_as(image)

    # --- tensors in, tensors out --------------------------------------------------------

    def coefficients(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[*shape] -> [num_chunks, h*w] transform coefficients (float32), chunk-major."""
        plan = self.plan(x.shape)
        (gr, gc), h, w = plan.grid, plan.chunk_rows, plan.chunk_cols
        image = self.transform.forward_image(plan.transform_input(x), plan, step)
        return image.view(gr, h, gc, w).permute(0, 2, 1, 3).reshape(plan.num_chunks, h * w)

    def encode(self, x: torch.Tensor, out: torch.Tensor, seed: int = 0, *,
               scratch: torch.Tensor | None = None) -> None:
        """The compressor protocol's encode: the top-k coefficients of every chunk of x,
        written into `out` (flat uint8 of payload_nbytes(x.shape) bytes). `seed` is the step
        (it picks the random transform's basis; dct and identity ignore it)."""
        plan = self.plan(x.shape)
        image = self.transform.forward_image(plan.transform_input(x), plan, seed, scratch=scratch)
        self.write(self.select(image, x.shape, scratch), x.shape, check_buffer(out, self.payload_nbytes(x.shape)))

    def read(self, payload: Payload, shape) -> Read:
        """(indices [n_chunks, k] int64, values [n_chunks, k] float32), validated: ValueError
        if malformed (a host read; `read_flagged` checks on the device)."""
        plan, k = self.plan(shape), self.k(shape)
        idx = self.coding(shape).unpack(payload.parts["indices"], plan.num_chunks)
        vals = self.codec.decode(payload.parts["values"], plan.num_chunks, k)
        if not bool(torch.isfinite(vals).all()):
            raise ValueError("malformed payload: non-finite values")
        return idx, vals

    def read_flagged(self, payload: Payload, shape) -> tuple[Read, list[torch.Tensor]]:
        """`read` without host reads: (the read, its 0-dim bool flags, True where the payload
        is malformed: indices out of range (then clamped into it) or non-finite values).
        `raise_malformed` turns the flags into read()'s ValueError."""
        plan, k = self.plan(shape), self.k(shape)
        idx, bad_index = self.coding(shape).unpack_flagged(payload.parts["indices"], plan.num_chunks)
        vals = self.codec.decode(payload.parts["values"], plan.num_chunks, k)
        return (idx, vals), [f for f in (bad_index, checks.nonfinite(vals)) if f is not None]

    def decode(self, buf: torch.Tensor, shape, seed: int = 0) -> torch.Tensor:
        """The compressor protocol's decode: the dense tensor (float32, `shape`) a receiver
        reconstructs from one rank's flat payload `buf`, validated as `read` does. `seed`:
        the step the sender encoded at."""
        shape = tuple(shape)
        return self.aggregate([self.read(Payload.from_buffer(buf, self.payload_spec(shape)), shape)], shape, seed)

    def aggregate(self, reads: Sequence[Read], shape, step: int = 0, mode: str = "mean", *,
                  out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Average of the ranks' decoded tensors, from their payloads' `read()` outputs (see the
        class docstring for `mode`), as float32 [*shape]. With `out` and `scratch` (flat
        float32, >= padded_numel each) the result is a view into `out`."""
        if mode not in AGGREGATIONS:
            raise ValueError(f"mode must be one of {AGGREGATIONS}, got {mode!r}")
        plan = self.plan(shape)
        if out is None:
            out = torch.empty(plan.padded_numel, device=reads[0][1].device)
        image = plan.matrix_in(out).zero_()
        for read in reads:  # rank order: a fixed summation order on every rank
            self.scatter(image, read, shape)
        if mode == "mean":
            image.div_(len(reads))
        else:
            counts = torch.zeros_like(image) if scratch is None else plan.matrix_in(scratch).zero_()
            for idx, vals in reads:
                self.scatter(counts, (idx, torch.ones_like(vals)), shape)
            image.div_(counts.clamp_(min=1))
        return plan.crop(self.transform.inverse_image(image, plan, step, scratch=scratch))
