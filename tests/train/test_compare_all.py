"""Every optimizer the harness registers, end to end in one `thinwire compare` on the tiny
preset with 2 real gloo workers (the run shared with test_cli.py and test_overlap_harness.py:
shared.py): it trains, its bytes are the ones its algorithm sends, and the table
compares it with its own dense counterpart."""

import math

import pytest

from tests.optim.registry import scale_slots
from tests.train.shared import COMPRESSED_AFTER, STEPS, SYNC_EVERY
from thinwire.comm.collectives import padded_numel
from thinwire.optim.exchange import gather_parts
from thinwire.train.config import get_preset
from thinwire.train.model import build_model
from thinwire.train.optimizers import OPTIMIZERS

NAMES = ("adam", "apmsqueeze", "muon", "ef21-muon", "adamw", "lordo", "diloco")
WARMUP = round(COMPRESSED_AFTER * STEPS)     # APMSqueeze's dense Adam steps
V, C, T = 256, 64, 32                        # tiny preset: vocab, width, context (one block)
N_PARAMS = V * C + T * C + 12 * C * C + 3 * C
HANDSHAKE = 8                                # the first step's 8-byte fingerprint all_gather
TENSORS = 9                                  # wte, wpe, 3 norms, qkv, proj, fc, out
PREFIX = 8 + math.ceil(TENSORS / 8)          # message header and presence bitmap (optim/protocol.py)
TRAILER = 1 + 16 + TENSORS                   # float all-reduces: flag, lockstep slots, presence counts


@pytest.fixture(scope="module")
def run(tiny_compare):
    steps = {name: tiny_compare["logs"][name]["step"] for name in NAMES}
    return tiny_compare["rows"], steps, tiny_compare["stdout"]


def test_every_registered_optimizer_is_compared():
    overlap = {f"{n}-overlap" for n in ("demo", "ef21-muon", "apmsqueeze", "lordo", "diloco", "sparseloco", "sign-demo")}
    others = {"powersgd", "demo", "adamw-allreduce", "adam-allreduce", "demo-lookahead"}   # test_cli.py, test_overlap_harness.py
    delayed = {"diloco-delayed", "sparseloco-delayed"}                  # sparseloco-delayed: below
    assert set(OPTIMIZERS) == set(NAMES) | {"sparseloco", "sign-demo"} | others | overlap | delayed


def test_each_trains(run):
    rows, steps, _ = run
    for name in NAMES:
        assert steps[name][0]["loss"] > 5.0 and rows[name]["val_loss"] < 4.0, name   # from ~ln(256) = 5.5


def test_ratio_against_own_counterpart(run):
    *_, stdout = run
    for name, counterpart in [("apmsqueeze", "adam"), ("ef21-muon", "muon"), ("lordo", "adamw"), ("diloco", "adamw")]:
        line = next(li for li in stdout.splitlines() if li.startswith(f"| {name} |"))
        assert f"vs {counterpart} |" in line, line


def test_apmsqueeze_dense_warmup_then_one_bit(run):
    _, steps, _ = run
    dense = 4 * (N_PARAMS + TRAILER)
    apm = steps["apmsqueeze"]
    assert apm[0]["payload_bytes"] == dense + HANDSHAKE
    assert all(s["payload_bytes"] == dense and s["collectives"] == 1 for s in apm[1:WARMUP])
    n, w = padded_numel(N_PARAMS, 2), 2
    # scale='tensor': 4 bytes per tensor part of a chunk (registry.scale_slots, from the tensors' sizes)
    sizes = [p.numel() for p in build_model(get_preset("tiny")).parameters()]
    scales = 4 * scale_slots(w, sizes)
    # all_to_all of the signs bound for the peer (the own chunk stays local), all_gather of chunks
    one_bit = (w - 1) * (PREFIX + scales + n // (8 * w)) + scales + n // (8 * w)
    assert all(s["payload_bytes"] == one_bit and s["collectives"] == 2 for s in apm[WARMUP:])
    # on the wire 1/32 of fp32 per phase, two phases vs the ring all-reduce's two passes
    dense_link = steps["adam"][-1]["link_bytes_sent"]
    assert dense_link / apm[-1]["link_bytes_sent"] > 30


def _topk_int8_bytes(d: int, ratio: float) -> int:
    """Top-K with int8 values on d elements: positions as a bitmap (d bits) or as K indices
    of ceil(log2 d) bits, whichever is smaller, then a 4-byte scale and K bytes."""
    k = min(d, max(1, round(ratio * d)))
    positions = min(math.ceil(d / 8), math.ceil(k * max(1, math.ceil(math.log2(d))) / 8))
    return positions + 4 + k


def test_ef21_muon_uplink_over_7x_smaller_than_dense_muon(run):
    """Default uplink top-44 % in int8: 1 byte per kept value plus a bitmap of positions
    (1 bit per element, smaller than 8-14-bit indices at 44 %): about 7.1x fewer bytes than
    fp32 on the tiny model."""
    _, steps, _ = run
    muon, ef21 = steps["muon"][-1]["payload_bytes"], steps["ef21-muon"][-1]["payload_bytes"]
    shapes = [(V, C), (T, C), (C,), (3 * C, C), (C, C), (C,), (4 * C, C), (C, 4 * C), (C,)]
    assert muon == 4 * (N_PARAMS + TRAILER)
    assert ef21 == PREFIX + sum(_topk_int8_bytes(math.prod(s), 0.44) for s in shapes)
    assert muon / ef21 > 7
    # replicated: one all-gathered message, in as many all_gathers as GatherAll cuts it into
    assert all(s["collectives"] == len(gather_parts(ef21)) for s in steps["ef21-muon"][1:])


def test_lordo_and_diloco_talk_only_at_syncs(run):
    _, steps, _ = run
    for name in ("lordo", "diloco"):
        talking = [s["step"] for s in steps[name] if s["collectives"]]
        assert talking == [1] + list(range(SYNC_EVERY, STEPS + 1, SYNC_EVERY)), name   # step 1: the handshake
        for s in steps[name]:
            if s["step"] % SYNC_EVERY == 0:
                assert s["payload_bytes"] >= 4 * N_PARAMS, name          # fp32 delta of every parameter


def test_sparseloco_sends_its_wire_format_at_syncs_only(tiny_compare):
    """At each sync one all_gather of the prefix and, per tensor, the top-128 of every 64 x 64
    chunk (the same 3.1 % of a smaller chunk: wpe's 32 x 64 keeps 64, a norm's 64 keeps 2) as
    ceil(log2 E)-bit indices, then 16 bytes of 2-bit levels and the codes, 4 per byte: 3851
    bytes, against 4 (N + trailer) = 271,208 for a dense fp32 step. Three syncs in 24 steps at
    3 % each train slowly: the bound is the untrained ~ln(256) = 5.5, not test_each_trains' 4.0."""
    steps, row = tiny_compare["logs"]["sparseloco"]["step"], tiny_compare["rows"]["sparseloco"]
    geometry = {(V, C): (4, 4096, 128), (T, C): (1, 2048, 64), (C,): (1, 64, 2), (3 * C, C): (3, 4096, 128),
                (C, C): (1, 4096, 128), (4 * C, C): (4, 4096, 128), (C, 4 * C): (4, 4096, 128)}
    shapes = [(V, C), (T, C), (C,), (3 * C, C), (C, C), (C,), (4 * C, C), (C, 4 * C), (C,)]
    per_sync = PREFIX + sum(math.ceil(n * k * math.ceil(math.log2(e)) / 8) + 16 + math.ceil(n * k / 4)
                            for n, e, k in (geometry[s] for s in shapes))
    assert per_sync == 3851
    for s in steps:
        sync = s["step"] % SYNC_EVERY == 0
        assert s["payload_bytes"] == (per_sync if sync else 0) + (HANDSHAKE if s["step"] == 1 else 0), s
        assert s["collectives"] == int(sync) + int(s["step"] == 1)
    assert steps[0]["loss"] > 5.0 and row["val_loss"] < 5.0


def test_sparseloco_delayed_sends_the_same_syncs_and_trains(tiny_compare):
    """delay = H (here 8): every sync leaves at its own step with the bytes of a plain one and
    lands a whole interval later, so the run sends what `sparseloco` sends, step by step, and
    trains as far (the same 5.0 bound: three sparse syncs in 24 steps)."""
    delayed, plain = tiny_compare["logs"]["sparseloco-delayed"]["step"], tiny_compare["logs"]["sparseloco"]["step"]
    assert [(s["payload_bytes"], s["collectives"]) for s in delayed] == \
        [(s["payload_bytes"], s["collectives"]) for s in plain]
    assert delayed[0]["loss"] > 5.0 and tiny_compare["rows"]["sparseloco-delayed"]["val_loss"] < 5.0
    assert tiny_compare["rows"]["sparseloco-delayed"]["val_loss"] != tiny_compare["rows"]["sparseloco"]["val_loss"]


def test_sign_demo_trains_on_a_fraction_of_demos_bytes(tiny_compare):
    """SignDeMo (top 4 of 64 x 64: a 12-bit index and a sign bit, 13 bits a coefficient, no scale) against DeMo in
    the same run (top 32, bf16 values: 28 bits a coefficient): at least 8x fewer payload bytes
    a step, and its loss falls from the first step's."""
    logs = tiny_compare["logs"]
    sign, demo = logs["sign-demo"]["step"], logs["demo"]["step"]
    assert sign[-1]["payload_bytes"] * 8 <= demo[-1]["payload_bytes"]
    assert tiny_compare["rows"]["sign-demo"]["val_loss"] < sign[0]["loss"] - 0.5
