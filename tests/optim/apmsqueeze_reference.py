"""Independent references for APMSqueeze's tests, and the code its gloo workers run.

The references are written from the algorithm's description (paper, issue, onebit docstring),
not from the code under test: messages are decoded with numpy's own bit unpacking, scales
are float64 norms, and the two-phase all-reduce is simulated for all ranks in one process.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from thinwire.comm import Communicator
from thinwire.comm.collectives import compressed_allreduce
from thinwire.comm.communicator import Pending
from thinwire.optim.apmsqueeze import APMSqueeze
from thinwire.optim.protocol import read_headers, write_header

HEADER = 8
N_VALUES, ROUNDS = 1000, 3            # all-reduce test: unpadded length and rounds of error feedback
SHAPES, WARMUP, STEPS = [(5, 7), (3,)], 5, 8     # three compressed steps after the warmup
LR, BETAS, EPS, WD = 0.01, (0.9, 0.99), 1e-8, 0.1


def padded(n: int, world: int) -> int:
    return math.ceil(n / (8 * world)) * 8 * world


# ---- independent decoding and simulation -------------------------------------------------

def np_decode(messages: torch.Tensor, c: int) -> torch.Tensor:
    """Rows of (float32 scale | packed signs, LSB first; 1 = +) -> float32 [rows, c]."""
    raw = messages.numpy()
    scales = raw[:, :4].copy().view("<f4")[:, 0]
    bits = np.unpackbits(raw[:, 4:], axis=1, bitorder="little")[:, :c]
    return torch.from_numpy(np.where(bits == 1, 1.0, -1.0).astype(np.float32) * scales[:, None])


def _c(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of each row: (RMS scale ||v||/sqrt(n) via float64, decoded ±scale, + for >= 0)."""
    scale = (torch.linalg.vector_norm(v.double(), dim=-1) / math.sqrt(v.shape[-1])).float()
    return scale, torch.where(v >= 0, 1.0, -1.0) * scale[..., None]


def simulate_allreduce(xs: torch.Tensor, we: torch.Tensor, se: torch.Tensor):
    """All ranks at once: xs, we [W, N]; se [W, c] -> (m̄ [N], new we [W, N], new se [W, c])."""
    world, n = xs.shape
    c = n // world
    y = (xs + we).view(world, world, c)        # [sender i, chunk j, c]
    _, y_hat = _c(y)
    z = y_hat[0].clone()
    for i in range(1, world):                  # rank order
        z += y_hat[i]
    z = z / world + se                         # [chunk j = server rank j, c]
    _, z_hat = _c(z)
    return z_hat.reshape(n), (y - y_hat).view(world, n), z - z_hat


def allreduce_inputs(world: int) -> torch.Tensor:
    """[ROUNDS, W, N] inputs; round 0 has exact zeros and -0.0 (errors are 0 then)."""
    n = padded(N_VALUES, world)
    xs = torch.randn(ROUNDS, world, n, generator=torch.Generator().manual_seed(5)) * 0.01
    xs[:, :, N_VALUES:] = 0.0                  # padding, as the optimizer sends it
    xs[0, :, 3], xs[0, :, 4] = 0.0, -0.0
    return xs


def adam_reference(world: int, grads: list, steps: int) -> torch.optim.AdamW:
    """torch.optim.AdamW on the mean (in rank order) of every rank's gradients."""
    params = [torch.nn.Parameter(t) for t in initial_params()]
    ref = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for t in range(steps):
        for k, p in enumerate(params):
            p.grad = sum(grads[r][t][k] for r in range(world)) / world
        ref.step()
    return ref


# ---- what the gloo workers run -------------------------------------------------------------

class Recording(Communicator):
    """The real communicator, keeping a copy of what each collective sent and received
    (asynchronous calls are completed at once, so the copy is of what arrived)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def _recorded(self, op, buf, kw):
        async_op = kw.pop("async_op", False)
        out = op(buf, **kw)
        self.log.append((buf.clone(), out.clone()))
        return Pending(None, out) if async_op else out

    def all_to_all(self, buf, **kw):
        return self._recorded(super().all_to_all, buf, kw)

    def all_gather(self, buf, **kw):
        return self._recorded(super().all_gather, buf, kw)


def allreduce_rounds(rank: int, world: int) -> list:
    comm = Recording()
    n = padded(N_VALUES, world)
    we, se = torch.zeros(n), torch.zeros(n // world)
    rounds, workspace = [], {}
    for t, xs in enumerate(allreduce_inputs(world)):
        header = torch.empty(HEADER, dtype=torch.uint8)
        write_header(header, t, 0)
        before = comm.stats.as_dict()
        we_new, se_new = we.clone(), se.clone()                     # updated in place
        m_bar = compressed_allreduce(comm, xs[rank], we_new, se_new, header=header,
                                     check=lambda h: read_headers(h, t), workspace=workspace)
        rounds.append({"x": xs[rank], "we": we, "se": se, "m_bar": m_bar, "we_new": we_new, "se_new": se_new,
                       "log": comm.log[-2:], "before": before, "after": comm.stats.as_dict()})
        we, se = we_new, se_new
    return rounds


def initial_params() -> list:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def grads_of(rank: int) -> list:
    gen = torch.Generator().manual_seed(100 + rank)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]


def optimizer_run(rank: int, world: int) -> dict:
    """WARMUP Adam steps then STEPS - WARMUP compressed steps; parameters after each step."""
    params = [torch.nn.Parameter(t) for t in initial_params()]
    opt = APMSqueeze(params, lr=LR, warmup_steps=WARMUP, betas=BETAS, eps=EPS, weight_decay=WD, scale="chunk")
    history = []
    for g in grads_of(rank):
        for p, gk in zip(params, g):
            p.grad = gk.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
    return {"history": history, "worker_error": opt.worker_error, "server_error": opt.server_error,
            "state_dict": opt.state_dict()}


def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as exc:  # the test inspects which error each rank saw
        return type(exc).__name__ + ": " + str(exc)


def _errors(opt) -> list:
    return [e.clone() for e in (opt.worker_error, opt.server_error) if e is not None]


def _try_step(rank: int, world: int, params, opt, nan: bool) -> tuple[str, bool, bool]:
    """(outcome, parameters unchanged, error buffers unchanged) of one step with all-ones
    gradients, NaN on the last rank if asked."""
    before, errors = [p.detach().clone() for p in params], _errors(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    if nan and rank == world - 1:
        params[0].grad[1, 2] = float("nan")
    status = _outcome(opt.step)
    after = _errors(opt)
    same_errors = len(after) == len(errors) and all(torch.equal(a, b) for a, b in zip(after, errors))
    return status, all(torch.equal(a, b) for a, b in zip(before, params)), same_errors


def nonfinite_run(rank: int, world: int, nonfinite: str) -> dict:
    """warmup_steps=5: step 1 (warmup) has a NaN on the last rank, steps 2-5 (warmup) are good,
    step 6 (compressed) is good, step 7 (compressed, error buffers no longer zero) has the
    NaN, step 8 is good; each good step proves no rank was left inside a collective."""
    params = [torch.nn.Parameter(t) for t in initial_params()]
    opt = APMSqueeze(params, lr=LR, warmup_steps=5, betas=BETAS, nonfinite=nonfinite, scale="chunk")
    def bad_then_good():
        return _try_step(rank, world, params, opt, nan=True), _try_step(rank, world, params, opt, nan=False)

    result = {"warmup": bad_then_good()}
    result["dense"] = [_try_step(rank, world, params, opt, nan=False) for _ in range(3)]    # steps 3-5
    result["primer"] = _try_step(rank, world, params, opt, nan=False)
    result["compressed"] = bad_then_good()
    result["params"] = torch.cat([p.detach().reshape(-1) for p in params])
    result["steps_done"] = opt.steps_done
    result["param_steps"] = [opt.state[p]["step"] for p in params]
    return result


ABSENT_SHAPES = [(40,), (30,), (20,)]     # flat ranges [0, 40), [40, 70), [70, 90)


def absent_run(rank: int, world: int) -> dict:
    """Five warmup steps and a compressed step with every gradient, then a compressed step in
    which the second parameter has a gradient on no rank and the third one only on rank 0."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ABSENT_SHAPES]
    opt = APMSqueeze(params, lr=LR, warmup_steps=5, betas=BETAS, weight_decay=WD, scale="chunk")
    for t in range(7):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(50 + 10 * rank + t)) for s in ABSENT_SHAPES]
        for k, p in enumerate(params):
            p.grad = grads[k] if (t < 6 or k == 0 or (k == 2 and rank == 0)) else None
        if t == 6:
            before = _snapshot(opt, params)
        opt.step()
    return {"before": before, "after": _snapshot(opt, params)}


def _snapshot(opt, params) -> dict:
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in params],
            "worker_error": opt.worker_error.clone(), "server_error": opt.server_error.clone()}


def suite(rank: int, world: int) -> dict:
    """Everything a world size needs, in one spawn (each spawn costs seconds of start-up)."""
    torch.manual_seed(0)
    out = {"allreduce": allreduce_rounds(rank, world), "optimizer": optimizer_run(rank, world),
           "grads": grads_of(rank)}
    out["absent"] = absent_run(rank, world)
    if world > 1:
        out["nonfinite"] = {policy: nonfinite_run(rank, world, policy) for policy in ("raise", "skip")}
    return out
