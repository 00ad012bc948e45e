"""Payload bytes per step of DeMo's wire format, beside the reference implementation's.

    python benchmarks/bytes_table.py [--models gpt2-small,olmo-1b] [--k 1,2,8,16,32]

For each model's parameter shapes (sizes only; nothing is allocated), chunk 64, each k and
each value format: payload MB/step per worker (one message: header + every parameter's
bit-packed indices and values), bytes per kept coefficient, ratio to a dense bf16
all-reduce of the gradient (2 bytes per parameter), and bloc97/DeMo's figure: 12 bytes
(int64 index + fp32 value) per kept coefficient, with its own chunking (largest divisor
of each dimension <= 64).
"""

from __future__ import annotations

import argparse
import math

from shapes import MODELS

from thinwire.compress import ChunkedTopK, matrix_shape
from thinwire.optim.protocol import HEADER_NBYTES

VALUES = ("fp32", "bf16", "int8", "sign")


def kept(shapes, k: int, chunk: int = 64) -> int:
    """Coefficients kept per step with thinwire's chunking."""
    comp = ChunkedTopK(topk=k, chunk=chunk)
    return sum(comp.plan(s).num_chunks * comp.k(s) for s in shapes)


def reference_kept(shapes, k: int, target: int = 64) -> int:
    """Coefficients bloc97/DeMo keeps: chunk = largest divisor <= 64 of each dimension."""
    total = 0
    for shape in shapes:
        dims = (shape[0],) if len(shape) == 1 else matrix_shape(shape)
        sizes = [max(d for d in range(1, min(n, target) + 1) if n % d == 0) for n in dims]
        total += math.prod(n // c for n, c in zip(dims, sizes)) * min(k, math.prod(sizes))
    return total


def rows(model: str, ks, chunk: int = 64):
    shapes = MODELS[model]()
    dense_bf16 = 2 * sum(math.prod(s) for s in shapes)
    for k in ks:
        ref_bytes = 12 * reference_kept(shapes, k)
        for values in VALUES:
            comp = ChunkedTopK(topk=k, chunk=chunk, values=values)
            payload = HEADER_NBYTES + sum(comp.payload_nbytes(s) for s in shapes)
            yield (model, k, values, payload / 1e6, payload / kept(shapes, k, chunk), dense_bf16 / payload,
                   ref_bytes / 1e6, dense_bf16 / ref_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-small,olmo-1b")
    parser.add_argument("--k", default="1,2,8,16,32")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    head = ("model", "k", "values", "MB/step", "B/coef", "x vs bf16", "ref MB/step", "ref x")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for model in args.models.split(","):
        dense = 2 * sum(math.prod(s) for s in MODELS[model]())
        print(f"| {model} | dense bf16 all-reduce | | {dense / 1e6:.2f} | | 1 | | |")
        for r in rows(model, ks):
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.2f} | {r[5]:.0f} | {r[6]:.3f} | {r[7]:.0f} |")


if __name__ == "__main__":
    main()
