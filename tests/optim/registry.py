"""Every optimizer configuration under test, in one list, with the bytes its wire format
makes per step, derived by hand from the documented formats (not from the code's output).

    REGISTRY[name] = Config(build, every, payload)
      build(params_or_groups, **kw) -> optimizer    (params: tensors or param-group dicts;
                                                     kw: process_group for two-tier runs)
      every: steps between exchanges (1: every step; K: LoRDO/DiLoCo sync every K)
      delay: steps between an exchange's start and its apply (1: overlap=True)
      payload(world, sizes) -> {tag: payload bytes this rank hands the collectives per exchange}

Message formats (thinwire.optim.protocol): byte messages start with an 8-byte header and a
presence bitmap of ceil(P / 8) bytes (P parameters in the layout); float all-reduces end
with a trailer of 1 + 16 + P floats.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

import thinwire

SYNC_EVERY = 4
APM_WARMUP = 4


class Config(NamedTuple):
    build: Callable
    every: int
    payload: Callable
    delay: int = 0


def prefix(sizes) -> int:
    return 8 + math.ceil(len(sizes) / 8)


def trailer(sizes) -> int:
    return 1 + 16 + len(sizes)


def dense_bytes(sizes, bytes_per_value: int) -> int:
    return (sum(sizes) + trailer(sizes)) * bytes_per_value


def _muon_and_adamw(params, **kw):
    params = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    matrices = [p for p in params if p.dim() == 2]
    others = [p for p in params if p.dim() != 2]
    return thinwire.DenseAllReduce([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-2)], **kw)


def onebit_bytes(world: int, sizes) -> int:
    """phase 1: (W − 1) chunks of prefix + 4-byte scale + N/(8W) sign bytes; phase 2: scale + signs."""
    n = max(1, math.ceil(sum(sizes) / (8 * world))) * 8 * world
    chunk = n // (8 * world)
    return (world - 1) * (prefix(sizes) + 4 + chunk) + 4 + chunk


DEMO = dict(lr=0.01, topk=8, chunk=16)
REGISTRY: dict[str, Config] = {
    # DeMo: its bytes depend on the chunk geometry of each shape: see demo_bytes below
    "demo": Config(lambda ps, **kw: thinwire.DeMo(ps, **DEMO, **kw), 1, None),
    "demo-param-domain": Config(lambda ps, **kw: thinwire.DeMo(ps, **DEMO, momentum_domain="param", **kw), 1, None),
    "demo-random-int8": Config(lambda ps, **kw: thinwire.DeMo(ps, **DEMO, transform="random", values="int8", **kw), 1, None),
    "dense-adamw": Config(lambda ps, **kw: thinwire.DenseAllReduce(torch.optim.AdamW(ps, lr=1e-2), **kw), 1,
                          lambda w, s: {"payload": dense_bytes(s, 4)}),
    "dense-sgd-bf16": Config(lambda ps, **kw: thinwire.DenseAllReduce(torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                                                      grad_dtype=torch.bfloat16, **kw), 1,
                             lambda w, s: {"payload": dense_bytes(s, 2)}),
    "dense-muon": Config(_muon_and_adamw, 1, lambda w, s: {"payload": dense_bytes(s, 4)}),
    # warmup longer than any run: dense fp32 all-reduce with the trailer every step
    "apmsqueeze-warmup": Config(lambda ps, **kw: thinwire.APMSqueeze(ps, lr=1e-2, warmup_steps=1000, **kw), 1,
                                lambda w, s: {"payload": dense_bytes(s, 4)}),
    # APM_WARMUP dense steps, then 1-bit phases (byte count checked from there on)
    "apmsqueeze-compressed": Config(lambda ps, **kw: thinwire.APMSqueeze(ps, lr=1e-2, warmup_steps=APM_WARMUP, **kw), 1,
                                    lambda w, s: {"payload": onebit_bytes(w, s)}),
    "ef21-server": Config(lambda ps, **kw: thinwire.EF21Muon(ps, lr=0.02, beta=0.3, uplink="identity+bf16", **kw), 1,
                          lambda w, s: {"payload": prefix(s) + 2 * sum(s), "downlink": prefix(s) + 4 * sum(s)}),
    "ef21-replicated": Config(lambda ps, **kw: thinwire.EF21Muon(ps, lr=0.02, beta=0.3, uplink="identity+bf16",
                                                                 topology="replicated", **kw), 1,
                              lambda w, s: {"payload": prefix(s) + 2 * sum(s)}),
    # overlap=True: each exchange applied by the next step() (its bytes still leave at its own step)
    "demo-overlap": Config(lambda ps, **kw: thinwire.DeMo(ps, **DEMO, overlap=True, **kw), 1, None, 1),
    # ... and between calls the parameters looked ahead by this rank's momentum (Psyche's correction)
    "demo-lookahead": Config(lambda ps, **kw: thinwire.DeMo(ps, **DEMO, overlap=True, lookahead="momentum", **kw), 1,
                             None, 1),
    "dense-adamw-overlap": Config(lambda ps, **kw: thinwire.DenseAllReduce(torch.optim.AdamW(ps, lr=1e-2),
                                                                           overlap=True, **kw), 1,
                                  lambda w, s: {"payload": dense_bytes(s, 4)}, 1),
    "apmsqueeze-compressed-overlap": Config(lambda ps, **kw: thinwire.APMSqueeze(ps, lr=1e-2, warmup_steps=APM_WARMUP,
                                                                                 overlap=True, **kw), 1,
                                            lambda w, s: {"payload": onebit_bytes(w, s)}, 1),
    "ef21-replicated-overlap": Config(lambda ps, **kw: thinwire.EF21Muon(ps, lr=0.02, beta=0.3, uplink="identity+bf16",
                                                                         topology="replicated", overlap=True, **kw),
                                      1, lambda w, s: {"payload": prefix(s) + 2 * sum(s)}, 1),
    "lordo-overlap": Config(lambda ps, **kw: thinwire.LoRDO(ps, lr=1e-2, rank=4, sync_every=SYNC_EVERY, overlap=True,
                                                            **kw), SYNC_EVERY,
                            lambda w, s: {"payload": dense_bytes(s, 4)}, 1),
    "diloco-overlap": Config(lambda ps, **kw: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-2),
                                                              sync_every=SYNC_EVERY, outer_lr=0.7, overlap=True, **kw),
                             SYNC_EVERY, lambda w, s: {"payload": dense_bytes(s, 4)}, 1),
    "lordo": Config(lambda ps, **kw: thinwire.LoRDO(ps, lr=1e-2, rank=4, sync_every=SYNC_EVERY, **kw), SYNC_EVERY,
                    lambda w, s: {"payload": dense_bytes(s, 4)}),
    "diloco": Config(lambda ps, **kw: thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-2),
                                                      sync_every=SYNC_EVERY, outer_lr=0.7, **kw), SYNC_EVERY,
                     lambda w, s: {"payload": dense_bytes(s, 4)}),
}


def chunk_bytes(values: str, rows: int, cols: int) -> int:
    return {"fp32": 4 * rows * cols, "bf16": 2 * rows * cols, "int8": 4 * rows + rows * cols,
            "sign": 4 * rows + math.ceil(rows * cols / 8)}[values]


# Chunk geometry with chunk=16 (thinwire.compress.chunking), as (chunks, elements per chunk):
#   (37, 24): 37 is prime -> padded to 48, 3 row chunks of 16; 24 -> divisor 12: 2 col chunks
#   (37,) -> (1, 37): padded to 48, 3 chunks of 1x16;  (10, 37): one row chunk, 37 -> 48: 3 of 10x16
#   (10,) -> (1, 10): one chunk of 10
# Shards of a 24 -> 64 -> 20 model on two ranks (test_sharded.py):
#   (32, 24): 32 -> divisor 16: 2 row chunks; 24 -> 12: 2 col chunks;  (32,) -> (1, 32): 2 of 1x16
#   (10, 64): one row chunk; 64 -> 16: 4 of 10x16
DEMO_GEOMETRY = {(37, 24): (6, 16 * 12), (37,): (3, 16), (10, 37): (3, 10 * 16), (10,): (1, 10),
                 (32, 24): (4, 16 * 12), (32,): (2, 16), (10, 64): (4, 10 * 16)}


def demo_bytes(shapes, values: str = "bf16", topk: int = 8) -> int:
    total = 8 + math.ceil(len(shapes) / 8)
    for shape in shapes:
        chunks, elems = DEMO_GEOMETRY[tuple(shape)]
        k = min(topk, elems)
        total += math.ceil(chunks * k * max(1, math.ceil(math.log2(elems))) / 8) + chunk_bytes(values, chunks, k)
    return total


def expected_payload(name: str, world: int, shapes) -> dict:
    """{tag: bytes} one exchange hands the collectives on a rank (before the 'downlink' root rule)."""
    if name.startswith("demo"):
        return {"payload": demo_bytes(shapes, "int8" if "int8" in name else "bf16")}
    return REGISTRY[name].payload(world, [math.prod(s) for s in shapes])
