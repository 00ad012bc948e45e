"""Compressors, pure tensor <-> bytes: every one satisfies the `Compressor` protocol
(`payload_nbytes(shape)`, `encode(x, out, seed)`, `decode(buf, shape, seed)`).

    protocol      the `Compressor` protocol
    topk          DeMo's `ChunkedTopK` (chunked transform + top-k per chunk, aggregation)
    sparseloco_topk  SparseLoCo's `SparseLoCoTopK` (a fixed density per chunk, 2-bit values per tensor)
    sparseloco_flat  `FlatSparseLoCo`: SparseLoCoTopK over a layout's tensors, their bytes packed and read by group
    chunking      `ChunkPlan`: how a tensor is cut into chunks; transforms: per-chunk bases
    payload       `Payload`: one message split into named uint8 parts
    ef21          the EF21 compressor base class and `Identity`
    sparse        `TopK`, `RandK`;  lowrank: `RankK`;  dct_topk: `DctTopK` (ChunkedTopK as EF21)
    value_stages  the value stage every EF21 compressor ends with (`thinwire.wire.VALUE_FORMATS`)
    spec          the spec-string grammar ('topk:0.05+natural') and `parse_compressor`
"""

from .chunking import ChunkPlan, chunk_size, matrix_shape
from .dct_topk import DctTopK
from .ef21 import EF21Compressor, Identity
from .lowrank import RankK
from .payload import Payload, PayloadSpec
from .protocol import Compressor
from .sparse import RandK, TopK
from .sparseloco_topk import SparseLoCoTopK
from .spec import COMPRESSOR_NAMES, parse_compressor
from .topk import AGGREGATIONS, ChunkedTopK
from .transforms import TRANSFORMS, ChunkTransform
from .value_stages import VALUE_STAGES, NaturalCodec

__all__ = ["AGGREGATIONS", "COMPRESSOR_NAMES", "ChunkPlan", "ChunkTransform", "ChunkedTopK", "Compressor", "DctTopK",
           "EF21Compressor", "Identity", "NaturalCodec", "Payload", "PayloadSpec", "RandK", "RankK", "SparseLoCoTopK",
           "TRANSFORMS", "TopK", "VALUE_STAGES", "chunk_size", "matrix_shape", "parse_compressor"]
