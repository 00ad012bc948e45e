"""Compressors: tensor -> Payload (named uint8 buffers) -> tensor, and deterministic aggregation."""

from .chunking import ChunkPlan, chunk_size, matrix_shape
from .payload import Payload, PayloadSpec
from .topk import AGGREGATIONS, ChunkedTopK
from .transforms import TRANSFORMS, ChunkTransform

__all__ = ["AGGREGATIONS", "ChunkPlan", "ChunkTransform", "ChunkedTopK", "Payload", "PayloadSpec",
           "TRANSFORMS", "chunk_size", "matrix_shape"]
