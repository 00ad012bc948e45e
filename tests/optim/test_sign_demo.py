"""SignDeMo (Psyche's 1-bit DeMo) against a plain float64 simulation of its equations, written
from the module docstring with its own DCT matrices and loops (no thinwire code): two real gloo
ranks, three steps; and its message, byte by byte, against the documented layout."""

from __future__ import annotations

import math

import pytest
import torch

import thinwire
from tests.dist import run_workers

LR, BETA, TOPK, CHUNK, WD, STEPS = 0.01, 0.9, 3, 16, 0.1, 3
SHAPES = [(16, 32), (16,)]          # chunks of 16 x 16 (two per matrix) and one of 16: no padding


def _dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix: D[k, j] = sqrt(2/n) cos(pi (2j + 1) k / 2n), row 0 / sqrt(2)."""
    k, j = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None, :]
    d = math.sqrt(2.0 / n) * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))
    d[0] /= math.sqrt(2.0)
    return d


def _chunks(shape) -> list[tuple[slice, slice]]:
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    return [(slice(r, r + min(rows, CHUNK)), slice(c, c + CHUNK)) for r in range(0, rows, CHUNK)
            for c in range(0, cols, CHUNK)]


def _forward(x: torch.Tensor) -> list[torch.Tensor]:
    """Each chunk's coefficients D_h X D_w^T, chunk by chunk."""
    x2 = x.view(1, -1) if x.dim() == 1 else x
    return [_dct(x2[r, c].shape[0]) @ x2[r, c] @ _dct(x2[r, c].shape[1]).T for r, c in _chunks(x.shape)]


def _inverse(coefficients: list[torch.Tensor], shape) -> torch.Tensor:
    out = torch.zeros((1, shape[0]) if len(shape) == 1 else shape, dtype=torch.float64)
    for (r, c), z in zip(_chunks(shape), coefficients):
        out[r, c] = _dct(z.shape[0]).T @ z @ _dct(z.shape[1])
    return out.view(shape)


def _kept(coefficients: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each chunk's TOPK largest |z| kept, the rest zero."""
    out = []
    for z in coefficients:
        flat = torch.zeros(z.numel(), dtype=torch.float64)
        top = z.reshape(-1).abs().argsort(descending=True)[:TOPK]
        flat[top] = z.reshape(-1)[top]
        out.append(flat.view(z.shape))
    return out


def _gradient(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(SHAPES[n], generator=torch.Generator().manual_seed(100 * step + 10 * rank + n))


def _simulate(start: list[torch.Tensor], world: int):
    """Every rank's momentum and the shared parameters after STEPS steps, in float64."""
    params = [p.double().clone() for p in start]
    momenta = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(world)]
    for step in range(STEPS):
        for n, shape in enumerate(SHAPES):
            votes = []
            for rank in range(world):
                m = momenta[rank][n].mul_(BETA).add_(LR * _gradient(rank, step, n).double())
                kept = _kept(_forward(m))
                m.sub_(_inverse(kept, shape))                            # the exact kept values leave M
                votes.append([torch.where(z != 0, torch.where(z >= 0, 1.0, -1.0), 0.0) for z in kept])
            # mean over the ranks that sent each coefficient (bloc97's scatter_reduce mean)
            mean = [sum(v[c] for v in votes) / torch.clamp(sum((v[c] != 0).double() for v in votes), min=1)
                    for c in range(len(votes[0]))]
            delta = _inverse(mean, shape)
            params[n] = params[n] * (1 - LR * WD) - LR * torch.sign(delta)
    return params, momenta


def _train(rank: int, world: int, start: list[torch.Tensor]):
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = thinwire.SignDeMo(params, lr=LR, beta=BETA, topk=TOPK, chunk=CHUNK, weight_decay=WD)
    sent = []
    for step in range(STEPS):
        for n, p in enumerate(params):
            p.grad = _gradient(rank, step, n)
        opt.step()
        sent.append(opt.comm_stats.last_step.payload_bytes)
    return [p.detach().clone() for p in params], [opt.state[p]["momentum"].clone() for p in params], sent


def test_two_ranks_follow_the_equations_and_send_the_documented_bytes():
    start = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)) for i, s in enumerate(SHAPES)]
    results = run_workers(_train, 2, args=(start,))
    params, momenta = _simulate(start, 2)
    for rank, (got, moms, sent) in enumerate(results):
        for n in range(len(SHAPES)):
            assert torch.allclose(got[n].double(), params[n], atol=1e-6), (rank, n)
            assert torch.allclose(moms[n].double(), momenta[rank][n], atol=1e-7, rtol=1e-5), (rank, n)
        # prefix: 8-byte header + 1 presence byte; per chunk 3 indices of ceil(log2 E) bits (E = 256: 8; the
        # vector's E = 16: 4) and 3 sign bits, each stream padded to whole bytes
        matrix, vector = 2 * 3 * 8 // 8 + math.ceil(2 * 3 / 8), math.ceil(3 * 4 / 8) + 1
        assert sent[1:] == [9 + matrix + vector] * (STEPS - 1)        # the first step also carries the handshake
    assert all(torch.equal(results[0][0][n], results[1][0][n]) for n in range(len(SHAPES)))


def test_bad_hyperparameters_are_named():
    p = [torch.nn.Parameter(torch.zeros(4))]
    for kwargs, name in (({"lr": -1.0}, "lr"), ({"beta": 1.0}, "beta"), ({"topk": 0}, "topk"),
                         ({"chunk": 2.5}, "chunk"), ({"weight_decay": -0.1}, "weight_decay"),
                         ({"aggregate": "median"}, "aggregate")):
        with pytest.raises(ValueError, match=name):
            thinwire.SignDeMo(p, **kwargs)


def test_demo_refuses_the_unscaled_signs():
    with pytest.raises(ValueError, match="signbit"):
        thinwire.DeMo([torch.nn.Parameter(torch.zeros(4))], values="signbit")
