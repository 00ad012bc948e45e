"""Every optimizer configuration under test, in one place, with the bytes its wire format
makes per step, derived by hand from the documented formats (not from the code's output).

    REGISTRY[name] = Config(build, every, payload)
      build(params_or_groups, **kw) -> optimizer    (params: tensors or param-group dicts;
                                                     kw: process_group for two-tier runs)
      every: steps between exchanges (1: every step; K: LoRDO/DiLoCo sync every K)
      delay: steps between an exchange's start and its apply (1: overlap=True)
      payload(world, sizes) -> {tag: payload bytes this rank hands the collectives per exchange}

REGISTRY's configurations run the whole contract (suite.py), flat and on two tiers
(sharded.py). VARIANTS holds the options those leave at their defaults (other wires,
compressors, schedules): each runs the 'run' case only, for LONG steps, at the world sizes
it lists, with every step's counters (payload and link bytes, collectives) checked per tag:

      counters(world, rank, step, shapes) -> {tag: counters} of the exchange at (0-based) step
      worlds, cases, steps, loss_ratio: where and what the suite runs (see Config)

CONFIGS is both, what suite.py and test_suite.py run.

Message formats (thinwire.optim.protocol): byte messages start with an 8-byte header and a
presence bitmap of ceil(P / 8) bytes (P parameters in the layout); float all-reduces end
with a trailer of 1 + 16 + P floats. Link bytes per collective (thinwire.comm.links): ring
all-reduce of n bytes 2n(W - 1)/W each way, ring all-gather n(W - 1) each way, all-to-all
n(W - 1)/W each way, gather n up (the root receives n(W - 1)), broadcast from a star
(the source sends n(W - 1), each peer receives n), rounded down; a world of one moves nothing.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

import thinwire

SYNC_EVERY = 4
APM_WARMUP = 5      # thinwire.optim.apmsqueeze.MIN_WARMUP_STEPS: fewer are refused
LONG = 50           # a variant's run: K = 5 and 10 divide it; resumed from a checkpoint at 25


class Config(NamedTuple):
    build: Callable
    every: int
    payload: Callable | None
    delay: int = 0
    worlds: tuple = (1, 2, 3)          # the world sizes test_suite.py runs it at
    cases: tuple | None = None         # the suite cases it runs (None: every one)
    steps: int | None = None           # the 'run' case's length (None: suite.STEPS), resumed at half
    loss_ratio: float = 0.8            # the run's final loss < loss_ratio x its initial loss, every rank
    counters: Callable | None = None   # counters(world, rank, step, shapes) -> {tag: counters}


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


def scale_slots(world: int, sizes) -> int:
    """scale='tensor' (the default): scales per chunk message, S = the most tensor parts any of
    the W chunks of c = N/W values holds, the padding after the last tensor counting as one."""
    n = max(1, math.ceil(sum(sizes) / (8 * world))) * 8 * world
    parts = list(sizes) + ([n - sum(sizes)] if n > sum(sizes) else [])
    ends = [sum(parts[:i + 1]) for i in range(len(parts))]                  # tensor k covers [ends[k-1], ends[k])
    c = n // world
    return max(sum(1 for k, end in enumerate(ends) if end > j * c and (ends[k - 1] if k else 0) < (j + 1) * c)
               for j in range(world))


def onebit_bytes(world: int, sizes) -> int:
    """phase 1: (W − 1) chunks of prefix + 4 S scale bytes + N/(8W) sign bytes; phase 2: scales + signs."""
    n = max(1, math.ceil(sum(sizes) / (8 * world))) * 8 * world
    chunk, scales = n // (8 * world), 4 * scale_slots(world, sizes)
    return (world - 1) * (prefix(sizes) + scales + chunk) + scales + chunk


DEMO = dict(lr=0.01, topk=8, chunk=16)
SPARSELOCO = dict(topk=64, chunk=16)     # density 64 / 16² = 1/4, 2-bit values, β 0.95, α 1


def _sparseloco(ps, **kw):
    return thinwire.SparseLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=1e-2),
                               **{"sync_every": SYNC_EVERY, **SPARSELOCO, **kw})


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
    # SignDeMo (Psyche's 1-bit DeMo): per chunk k indices and k sign bits, no scale: see sign_demo_bytes below
    "sign-demo": Config(lambda ps, **kw: thinwire.SignDeMo(ps, lr=0.01, topk=8, chunk=16, **kw), 1, None),
    # its overlap is the envelope's, which every other overlap entry runs at worlds 1-3: world 2 here
    "sign-demo-overlap": Config(lambda ps, **kw: thinwire.SignDeMo(ps, lr=0.01, topk=8, chunk=16, overlap=True, **kw),
                                1, None, 1, worlds=(2,)),
    # SparseLoCo: its bytes depend on the chunk geometry of each shape: see sparseloco_bytes below
    "sparseloco": Config(lambda ps, **kw: _sparseloco(ps, **kw), SYNC_EVERY, None),
    "sparseloco-overlap": Config(lambda ps, **kw: _sparseloco(ps, overlap=True, **kw), SYNC_EVERY, None, 1),
    # delay = K: each sync lands a whole interval later, the replicas keeping their local steps
    "sparseloco-delayed": Config(lambda ps, **kw: _sparseloco(ps, overlap=True, delay=SYNC_EVERY, **kw), SYNC_EVERY,
                                 None, SYNC_EVERY),
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


def sign_demo_bytes(shapes, topk: int = 8) -> int:
    """The prefix, then per tensor its C·k indices in ceil(log2 E) bits and C·k sign bits (signbit)."""
    total = 8 + math.ceil(len(shapes) / 8)
    for shape in shapes:
        chunks, elems = DEMO_GEOMETRY[tuple(shape)]
        k = min(topk, elems)
        total += math.ceil(chunks * k * max(1, math.ceil(math.log2(elems))) / 8) + math.ceil(chunks * k / 8)
    return total


# SparseLoCo's k per chunk of E elements: round(E · topk / chunk²) (half to even), at least 1. With
# topk 64, chunk 16 (DEMO_GEOMETRY's chunks): E = 192 -> 48, 16 -> 4, 160 -> 40, 10 -> 2.5 -> 2.
SPARSELOCO_K = {192: 48, 16: 4, 160: 40, 10: 2}


def sparseloco_bytes(shapes, values: str = "2bit") -> int:
    """The prefix, then per tensor its C·k indices in ceil(log2 E) bits, then its values: 2bit one
    row of 4 float32 levels and C·k 2-bit codes; other formats one row per chunk."""
    total = 8 + math.ceil(len(shapes) / 8)
    for shape in shapes:
        chunks, elems = DEMO_GEOMETRY[tuple(shape)]
        k = SPARSELOCO_K[elems]
        values_bytes = 16 + math.ceil(chunks * k / 4) if values == "2bit" else chunk_bytes(values, chunks, k)
        total += math.ceil(chunks * k * max(1, math.ceil(math.log2(elems))) / 8) + values_bytes
    return total


def expected_payload(name: str, world: int, shapes) -> dict:
    """{tag: bytes} one exchange hands the collectives on a rank (before the 'downlink' root rule)."""
    if name.startswith("demo"):
        return {"payload": demo_bytes(shapes, "int8" if "int8" in name else "bf16")}
    if name.startswith("sparseloco"):
        return {"payload": sparseloco_bytes(shapes)}
    if name.startswith("sign-demo"):
        return {"payload": sign_demo_bytes(shapes)}
    return REGISTRY[name].payload(world, [math.prod(s) for s in shapes])


# ---- every step's counters, per tag: {payload_bytes, link_bytes_sent, link_bytes_received, collectives}

def link(payload: int, sent: int, received: int, collectives: int = 1) -> dict:
    return {"payload_bytes": payload, "link_bytes_sent": sent, "link_bytes_received": received,
            "collectives": collectives}


def plus(*counters: dict) -> dict:
    return {key: sum(c[key] for c in counters) for key in link(0, 0, 0, 0)}


def all_reduce(n: int, world: int) -> dict:
    each = 2 * n * (world - 1) // world
    return link(n, each, each)


def all_gather(n: int, world: int) -> dict:
    return link(n, n * (world - 1), n * (world - 1))


def gather(n: int, world: int, root: bool) -> dict:
    return link(n, 0 if root else n, n * (world - 1) if root else 0)


def broadcast(n: int, world: int, root: bool) -> dict:
    """The source's payload; a peer hands over nothing and receives n."""
    return link(n if root else 0, n * (world - 1) if root else 0, 0 if root else n)


HANDSHAKE = 8       # the first step of a group of two or more: an all-gather of an 8-byte fingerprint


def onebit_counters(world: int, sizes) -> dict:
    """APMSqueeze's compressed all-reduce, N values padded to 8W, chunks of c = N / W: phase 1
    an all-to-all of W chunks of prefix + 4 S scale bytes + c/8 sign bytes (the own chunk is not
    handed over), phase 2 an all-gather of S scales and c/8 sign bytes (S: `scale_slots`)."""
    c, scales = math.ceil(sum(sizes) / (8 * world)) * 8, 4 * scale_slots(world, sizes)
    chunk = prefix(sizes) + scales + c // 8            # all-to-all of n = W chunks: n(W - 1)/W each way
    return plus(link((world - 1) * chunk, (world - 1) * chunk, (world - 1) * chunk), all_gather(scales + c // 8, world))


def apmsqueeze_counters(warmup: int) -> Callable:
    """Steps 1..warmup: one fp32 all-reduce of the gradients and the trailer; then 1-bit."""
    def counters(world, rank, step, shapes):
        sizes = [math.prod(s) for s in shapes]
        if step < warmup:
            return {"payload": all_reduce(dense_bytes(sizes, 4), world)}
        return {"payload": onebit_counters(world, sizes)}
    return counters


def delta_sync_counters(wire: str) -> Callable:
    """LoRDO's and DiLoCo's sync. fp32: an all-reduce of the float32 deltas and the trailer;
    bf16 / int8: an all-gather of the prefix and the deltas in bf16, or per block of 256
    values (the last zero-padded) one fp32 scale and 256 int8 values."""
    def counters(world, rank, step, shapes):
        sizes = [math.prod(s) for s in shapes]
        if wire == "fp32":
            return {"payload": all_reduce(dense_bytes(sizes, 4), world)}
        n, blocks = sum(sizes), math.ceil(sum(sizes) / 256)
        return {"payload": all_gather(prefix(sizes) + (2 * n if wire == "bf16" else 4 * blocks + 256 * blocks), world)}
    return counters


# EF21-Muon's messages for problem.py's model, derived by hand: shapes (37, 24), (37,), (10, 37),
# (10,), sizes 888, 37, 370, 10, index widths ceil(log2 n) = 10, 6, 9, 4 bits.
PROBLEM_SHAPES = [(37, 24), (37,), (10, 37), (10,)]
PROBLEM_SIZES = (888, 37, 370, 10)


def topk_natural(ks) -> int:
    """Top-K with natural values: K bit-packed indices, K sign bits, K exponent bytes."""
    return sum(math.ceil(k * max(1, math.ceil(math.log2(n))) / 8) + math.ceil(k / 8) + k
               for k, n in zip(ks, PROBLEM_SIZES))


def ef21_counters(up: int, down: int | None) -> Callable:
    """Payload bytes after the prefix. down None: topology='replicated', one all-gather of the
    uplink, nothing sent down; else a gather of the uplink to rank 0 ('payload') and a
    broadcast of the downlink from it ('downlink')."""
    def counters(world, rank, step, shapes):
        assert [tuple(s) for s in shapes] == PROBLEM_SHAPES, "sizes derived for problem.py's model"
        if down is None:
            return {"payload": all_gather(prefix(shapes) + up, world)}
        return {"payload": gather(prefix(shapes) + up, world, rank == 0),
                "downlink": broadcast(prefix(shapes) + down, world, rank == 0)}
    return counters


def _ef21(params, split_lmo=None, **kw):
    """split_lmo: the 1-D parameters in a group of their own with that LMO."""
    params = list(params)
    if split_lmo is None:
        return thinwire.EF21Muon(params, **kw)
    return thinwire.EF21Muon([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "lmo": split_lmo}], **kw)


def _diloco(ps, sgd: bool = False, **kw):
    """Inner SGD (lr 0.05, momentum 0.9) or AdamW (lr 0.03), a sync every 10 steps."""
    if sgd:
        return thinwire.DiLoCo(ps, inner=lambda q: torch.optim.SGD(q, lr=0.05, momentum=0.9), sync_every=10, **kw)
    return thinwire.DiLoCo(ps, inner=lambda q: torch.optim.AdamW(q, lr=0.03), sync_every=10, **kw)


def variant(build: Callable, counters: Callable, worlds: tuple, every: int = 1) -> Config:
    """An option REGISTRY leaves at its default: the 'run' case, LONG steps, the loss halved."""
    return Config(build, every, None, worlds=worlds, cases=("run",), steps=LONG, loss_ratio=0.5, counters=counters)


LORDO = dict(lr=0.01, rank=4, omega=0.97, clip=1.0)
VARIANTS: dict[str, Config] = {
    # resumed at step 25 inside a 30-step warmup (weight decay on): switches to 1-bit after the resume
    "apmsqueeze-resume-in-warmup": variant(
        lambda ps, **kw: thinwire.APMSqueeze(ps, lr=0.01, warmup_steps=30, weight_decay=0.01, **kw),
        apmsqueeze_counters(30), (1, 2, 3, 4)),
    "apmsqueeze-no-bias-correction": variant(
        lambda ps, **kw: thinwire.APMSqueeze(ps, lr=0.003, warmup_steps=10, bias_correction=False, **kw),
        apmsqueeze_counters(10), (1, 2, 3, 4)),
    "lordo-k5-int8": variant(lambda ps, **kw: thinwire.LoRDO(ps, **LORDO, sync_every=5, wire="int8", **kw),
                             delta_sync_counters("int8"), (1, 3), every=5),
    "lordo-bf16-outer": variant(lambda ps, **kw: thinwire.LoRDO(ps, **LORDO, sync_every=5, wire="bf16", outer_lr=0.7,
                                                                outer_momentum=0.5, **kw),
                                delta_sync_counters("bf16"), (1, 3), every=5),
    "lordo-no-ef-wd": variant(lambda ps, **kw: thinwire.LoRDO(ps, **LORDO, sync_every=10, error_feedback=False,
                                                              weight_decay=0.01, **kw),
                              delta_sync_counters("fp32"), (1, 3), every=10),
    "diloco-sgd": variant(lambda ps, **kw: _diloco(ps, sgd=True, **kw), delta_sync_counters("fp32"), (1, 2), every=10),
    "diloco-bf16": variant(lambda ps, **kw: _diloco(ps, wire="bf16", **kw), delta_sync_counters("bf16"), (1, 2),
                           every=10),
    "diloco-delayed": variant(lambda ps, **kw: _diloco(ps, overlap=True, delay=7, **kw), delta_sync_counters("fp32"),
                              (1, 2), every=10),
    "diloco-int8-skip": variant(lambda ps, **kw: _diloco(ps, wire="int8", nonfinite="skip", **kw),
                                delta_sync_counters("int8"), (1, 2), every=10),
    # SparseLoCo on DCT coefficients, int8 values (a scale per chunk), the reference's mean over senders
    "sparseloco-dct-int8-senders": variant(
        lambda ps, **kw: _sparseloco(ps, transform="dct", values="int8", aggregate="senders", sync_every=5, **kw),
        lambda world, rank, step, shapes: {"payload": all_gather(sparseloco_bytes(shapes, "int8"), world)},
        (1, 3), every=5),
    # K = round(0.05 n) = 44, 2, 18, 1 (at least 1), as indices (fewer bytes than a bitmap here);
    # identity down: 4 bytes per element
    "ef21-server-topk-natural": variant(lambda ps, **kw: _ef21(ps, lr=0.02, uplink="topk:0.05+natural", **kw),
                                        ef21_counters(topk_natural((44, 2, 18, 1)), 4 * sum(PROBLEM_SIZES)), (1, 3)),
    # Rand-K up: K = round(0.3 n) = 266, 11, 111, 3 fp32 values, no indices (a shared seed); nothing down
    "ef21-replicated-randk": variant(lambda ps, **kw: _ef21(ps, lr=0.02, beta=0.2, uplink="randk:0.3",
                                                            topology="replicated", downlink="topk:0.2+natural", **kw),
                                     ef21_counters(4 * (266 + 11 + 111 + 3), None), (1, 3)),
    # DeMo's chunk geometry (chunk 16, k = 8: DEMO_GEOMETRY), int8 values up; natural down: 9 bits per element
    "ef21-server-dct-int8": variant(lambda ps, **kw: _ef21(ps, lr=0.02, uplink="dct-topk:8:16+int8", downlink="natural",
                                                           **kw),
                                    ef21_counters(demo_bytes(PROBLEM_SHAPES, "int8") - prefix(PROBLEM_SHAPES),
                                                  sum(math.ceil(n / 8) + n for n in PROBLEM_SIZES)), (1,)),
    # rank 2: factors (37 + 24) * 2 and (10 + 37) * 2 fp32 values, vectors whole; bf16 down; sign LMO for vectors
    "ef21-server-rank-sign": variant(lambda ps, **kw: _ef21(ps, lr=0.02, uplink="rank:2", downlink="identity+bf16",
                                                            split_lmo="sign", **kw),
                                     ef21_counters(4 * ((37 + 24) * 2 + 37 + (10 + 37) * 2 + 10),
                                                   2 * sum(PROBLEM_SIZES)), (1,)),
}
CONFIGS: dict[str, Config] = {**REGISTRY, **VARIANTS}
