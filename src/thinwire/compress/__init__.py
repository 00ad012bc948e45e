"""Compressors: tensor -> Payload (named uint8 buffers) -> tensor, and deterministic aggregation."""

from .chunking import ChunkPlan, chunk_size, matrix_shape
from .lowrank import RankK
from .natural import VALUE_STAGES, NaturalCodec
from .payload import Payload, PayloadSpec
from .sparse import EF21Compressor, Identity, RandK, TopK
from .spec import COMPRESSOR_NAMES, DctTopK, parse_compressor
from .topk import AGGREGATIONS, ChunkedTopK
from .transforms import TRANSFORMS, ChunkTransform

__all__ = ["AGGREGATIONS", "COMPRESSOR_NAMES", "ChunkPlan", "ChunkTransform", "ChunkedTopK", "DctTopK", "EF21Compressor",
           "Identity", "NaturalCodec", "Payload", "PayloadSpec", "RandK", "RankK", "TRANSFORMS", "TopK", "VALUE_STAGES",
           "chunk_size", "matrix_shape", "parse_compressor"]
