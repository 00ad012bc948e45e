"""APMSqueeze's scale='tensor' (DeepSpeed's granularity, `thinwire.comm.onebit_scales.TensorScales`)
against a plain reference written from the description: each tensor's worker scale is the RMS
of its whole y_k (float64), each server scale the RMS of one tensor's part of the server's
chunk; the messages decoded with numpy from the bytes actually sent. Worlds 2 and 3, real gloo."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.optim import apmsqueeze_reference as ref
from tests.optim.suite import on_world
from thinwire.comm.collectives import OneBitAllReduce, padded_numel
from thinwire.comm.onebit_scales import TensorScales
from thinwire.optim.apmsqueeze import APMSqueeze
from thinwire.optim.protocol import write_header

SIZES = [100, 37, 5, 300, 1, 64]           # 507 values: tensors cross chunk borders, one is tiny
ROUNDS = 3


def _tensor_of(n_padded: int) -> np.ndarray:
    """The tensor each element belongs to; the padding is a part of its own."""
    ids = np.concatenate([np.full(s, k) for k, s in enumerate(SIZES)])
    return np.concatenate([ids, np.full(n_padded - ids.size, len(SIZES))])


def _parts(ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of equal ids."""
    cuts = [0, *(np.flatnonzero(np.diff(ids)) + 1).tolist(), ids.size]
    return list(zip(cuts[:-1], cuts[1:]))


def _signed_rms(v: np.ndarray) -> np.ndarray:
    scale = np.float32(math.sqrt(float(np.mean(v.astype(np.float64) ** 2))))
    return np.where(v >= 0, scale, -scale).astype(np.float32)


def simulate(xs: np.ndarray, we: np.ndarray, se: np.ndarray):
    """All ranks at once: xs, we [W, N]; se [W, c] -> (m̄ [N], new we, new se)."""
    world, n = xs.shape
    c, ids = n // world, _tensor_of(n)
    y = xs + we
    y_hat = np.empty_like(y)
    for start, stop in _parts(ids):                                     # one worker scale per tensor
        for i in range(world):
            y_hat[i, start:stop] = _signed_rms(y[i, start:stop])
    z = y_hat[0].reshape(world, c).copy()
    for i in range(1, world):                                            # rank order
        z += y_hat[i].reshape(world, c)
    z = z / np.float32(world) + se
    z_hat = np.empty_like(z)
    for j in range(world):                                               # one server scale per tensor part
        for start, stop in _parts(ids[j * c:(j + 1) * c]):
            z_hat[j, start:stop] = _signed_rms(z[j, start:stop])
    return z_hat.reshape(n), y - y_hat, z - z_hat


def _rounds(rank: int, world: int) -> list:
    comm = ref.Recording()
    n = padded_numel(sum(SIZES), world)
    reduce = OneBitAllReduce(comm, scales=TensorScales(SIZES, world, n, "cpu"))
    we, se, out = torch.zeros(n), torch.zeros(n // world), []
    gen = torch.Generator().manual_seed(1)
    for t in range(ROUNDS):
        xs = torch.randn(world, n, generator=gen) * torch.linspace(0.001, 1.0, n)   # tensors of unlike sizes
        xs[:, sum(SIZES):] = 0.0
        header = torch.empty(ref.HEADER, dtype=torch.uint8)
        write_header(header, t, 0)
        before = (we.clone(), se.clone())
        reduce.start(xs[rank], we, header)
        reduce.wait_headers()
        m_bar = reduce.finish(we, se)
        out.append({"xs": xs, "we": before[0], "se": before[1], "m_bar": m_bar.clone(), "we_new": we.clone(),
                    "se_new": se.clone(), "log": comm.log[-2:]})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_scales_allreduce_matches_the_plain_reference(world):
    results = on_world(_rounds, world, timeout=300)
    n = padded_numel(sum(SIZES), world)
    scales = TensorScales(SIZES, world, n, "cpu")
    slots, c = scales.count, n // world
    for t in range(ROUNDS):
        got = [r[t] for r in results]
        xs = got[0]["xs"].numpy()
        we = np.stack([g["we"].numpy() for g in got])
        se = np.stack([g["se"].numpy() for g in got])
        m_bar, we_new, se_new = simulate(xs, we, se)
        for rank, g in enumerate(got):
            assert torch.equal(g["m_bar"], got[0]["m_bar"])                       # every rank decodes the same
            np.testing.assert_allclose(g["m_bar"].numpy(), m_bar, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(g["we_new"].numpy(), we_new[rank], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(g["se_new"].numpy(), se_new[rank], rtol=1e-5, atol=1e-6)
            sent = g["log"][0][0].view(world, -1)                                 # [W, header | 4S | c/8]
            assert sent.shape[1] == ref.HEADER + 4 * slots + c // 8
            raw = sent.numpy()
            ids = _tensor_of(n).reshape(world, c)
            decoded = np.empty((world, c), dtype=np.float32)
            for j in range(world):                                                # slot k: the k-th part in chunk j
                part_scales = raw[j, ref.HEADER: ref.HEADER + 4 * slots].copy().view("<f4")
                bits = np.unpackbits(raw[j, ref.HEADER + 4 * slots:], bitorder="little")
                for k, (start, stop) in enumerate(_parts(ids[j])):
                    decoded[j, start:stop] = np.where(bits[start:stop] == 1, 1.0, -1.0) * part_scales[k]
            y = g["xs"][rank] + g["we"]
            assert torch.equal(g["we_new"], y - torch.from_numpy(decoded.reshape(-1)))   # e_w = y − ŷ exactly


def test_tensor_scale_bytes_per_step_and_bad_argument():
    params = [torch.nn.Parameter(torch.randn(s)) for s in SIZES]
    with pytest.raises(ValueError, match="scale"):
        APMSqueeze(params, lr=1e-2, warmup_steps=5, scale="layer")
    sent = {}
    for scale in ("chunk", "tensor"):
        opt = APMSqueeze(params, lr=1e-2, warmup_steps=5, scale=scale)
        for _ in range(6):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        sent[scale] = opt.comm_stats.last_step.payload_bytes
    n = padded_numel(sum(SIZES), 1)                                  # world 1: only the all_gather is handed over
    assert sent == {"chunk": 4 + n // 8, "tensor": 4 * (len(SIZES) + 1) + n // 8}
