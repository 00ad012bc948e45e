"""The argument mappings of docs/coming-from.md, checked where the page claims an equality.

Each reference below is written here from the peer's equations as docs/coming-from.md states
them (plain torch, one process), not from thinwire's code:

  * bloc97/DeMo's chunk rule: each dimension cut by its largest divisor <= chunk;
  * Templar's SparseLoCo round with outer learning rate a: e <- beta e + a (theta0 - theta),
    top-k of every chunk of e, e <- e - sent, theta0 <- theta0 - a * mean over senders; it is
    thinwire's SparseLoCo with outer_lr = a**2 (error_decay = beta, aggregate='senders');
  * DeepSpeed's OnebitAdam warmup: its first step() only initialises; then Adam without bias
    correction, weight decay added to the update, until step == freeze_step; thinwire's
    APMSqueeze with warmup_steps = freeze_step - 1 and bias_correction=False;
  * torchft's DiLoCo: the pseudo-gradient theta0 - theta as .grad, parameters restored to
    theta0, torch.optim.SGD(lr, momentum, nesterov=True).step(); thinwire's DiLoCo with
    outer_lr and outer_momentum.

bloc97/DeMo's step itself is checked step for step by tests/optim/test_demo_reference.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import thinwire
from thinwire.compress.chunking import chunk_size


# ---- bloc97/DeMo: which chunk a dimension gets ------------------------------------------------

def reference_chunk(n: int, target: int) -> int:
    """bloc97/DeMo's `_get_smaller_split`: the largest divisor of n that is <= target (n itself
    when n <= target)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


@pytest.mark.parametrize("target", [32, 64])
def test_demo_chunks_as_the_reference_where_a_divisor_lies_in_half_chunk_to_chunk(target):
    same = padded = 0
    for n in range(1, 1025):
        d = reference_chunk(n, target)
        if n <= target or 2 * d >= target:
            assert chunk_size(n, target) == (d, n), n                   # the same chunks, no padding
            same += 1
        else:
            assert chunk_size(n, target) == (target, -(-n // target) * target), n   # zero-padded
            padded += 1
    assert same and padded


def test_130_is_26_wide_chunks_in_the_reference_and_padded_to_192_in_thinwire():
    assert reference_chunk(130, 64) == 26          # divisors 1 2 5 10 13 26 65 130
    assert chunk_size(130, 64) == (64, 192)
    assert reference_chunk(131, 64) == 1           # a prime: chunks of 1 in the reference
    assert chunk_size(131, 64) == (64, 192)


# ---- Templar's SparseLoCo: outer learning rate a is outer_lr = a² ----------------------------

SHAPES = [(8, 12), (12, 4)]      # every dimension a multiple of the chunk: both cut 4 x 4 chunks
CHUNK, TOPK, H, SYNCS, BETA, INNER_LR = 4, 3, 3, 3, 0.9, 0.05


def _gradients(steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def _initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _grad(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return 0.5 * p + noise          # a quadratic's gradient plus fixed noise: depends on where p is


def templar_sparseloco(a: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Templar's round at outer learning rate a, one worker, quantization off: H steps of SGD,
    Δ = θ₀ − θ, e ← β e + a Δ, top-k by magnitude in every CHUNK x CHUNK chunk of e, e ← e − sent,
    θ₀ ← θ₀ − a · (mean over the senders of each element: one worker, its own values)."""
    params = [torch.nn.Parameter(p.clone()) for p in _initial()]
    inner = torch.optim.SGD(params, lr=INNER_LR)           # the inner optimizer is the user's in both
    anchors = [p.detach().clone() for p in params]
    errors = [torch.zeros_like(p) for p in anchors]
    grads = _gradients(H * SYNCS)
    for step in range(H * SYNCS):
        for p, noise in zip(params, grads[step]):
            p.grad = _grad(p.detach(), noise)
        inner.step()
        if (step + 1) % H:
            continue
        for p, anchor, e in zip([p.detach() for p in params], anchors, errors):
            e.mul_(BETA).add_(anchor - p, alpha=a)
            r, c = e.shape
            chunks = e.reshape(r // CHUNK, CHUNK, c // CHUNK, CHUNK).permute(0, 2, 1, 3).reshape(
                r // CHUNK, c // CHUNK, CHUNK * CHUNK)
            idx = chunks.abs().topk(TOPK, dim=-1).indices
            kept = torch.zeros_like(chunks).scatter(-1, idx, chunks.gather(-1, idx))
            sent = kept.reshape(r // CHUNK, c // CHUNK, CHUNK, CHUNK).permute(0, 2, 1, 3).reshape(r, c)
            e.sub_(sent)
            anchor.sub_(sent, alpha=a)          # the outer SGD step, lr a
            p.copy_(anchor)
    return [p.detach() for p in params], errors


def thinwire_sparseloco(outer_lr: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [torch.nn.Parameter(p.clone()) for p in _initial()]
    opt = thinwire.SparseLoCo(params, inner=lambda ps: torch.optim.SGD(ps, lr=INNER_LR), sync_every=H,
                              topk=TOPK, chunk=CHUNK, values="fp32", error_decay=BETA, outer_lr=outer_lr,
                              aggregate="senders")
    for noises in _gradients(H * SYNCS):
        for p, noise in zip(params, noises):
            p.grad = _grad(p.detach(), noise)
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["error"] for p in params]


@pytest.mark.parametrize("a", [0.5, 0.3])
def test_templar_outer_lr_a_is_sparseloco_outer_lr_a_squared(a):
    """Templar's e is a times thinwire's (top-k picks the same positions of a scaled e), so its
    step a · (a Δ̄) is thinwire's outer_lr · Δ̄ with outer_lr = a²; equal to float rounding
    (thinwire fuses e ← Δ + β e into one operation)."""
    ref_params, ref_errors = templar_sparseloco(a)
    params, errors = thinwire_sparseloco(a * a)
    wrong, _ = thinwire_sparseloco(a)                    # outer_lr = a is another run
    for p, q, e, f, w in zip(params, ref_params, errors, ref_errors, wrong):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        assert torch.allclose(e * a, f, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(w, q, rtol=1e-3, atol=1e-4)


# ---- DeepSpeed's OnebitAdam: freeze_step = F is F − 1 Adam steps -----------------------------

class OnebitAdamWarmup:
    """DeepSpeed OnebitAdam's uncompressed stage for one tensor, from its equations: step() 1
    initialises (moments and parameter untouched); steps 2..F: m ← β1 m + (1 − β1) g,
    v ← β2 v + (1 − β2) g², θ ← θ − lr (m / (√v + ε) + λ θ), no bias correction; after step F
    the stage ends (v frozen). The gradient is the engine's all-reduced mean (one worker: g)."""

    def __init__(self, p, lr, freeze_step, betas, eps, weight_decay):
        self.p, self.lr, self.freeze_step, self.betas, self.eps, self.wd = p, lr, freeze_step, betas, eps, weight_decay
        self.m, self.v, self.step_count, self.adam_steps = torch.zeros_like(p), torch.zeros_like(p), 0, 0

    def step(self, g):
        self.step_count += 1
        if self.step_count == 1:
            return
        assert self.step_count <= self.freeze_step
        b1, b2 = self.betas
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        self.p -= self.lr * (self.m / (self.v.sqrt() + self.eps) + self.wd * self.p)
        self.adam_steps += 1


def test_deepspeed_freeze_step_f_is_apmsqueeze_warmup_f_minus_1_without_bias_correction():
    F, lr, betas, eps, wd = 7, 1e-2, (0.9, 0.999), 1e-8, 0.01
    g = torch.Generator().manual_seed(2)
    start = torch.randn(5, 8, generator=g)
    grads = [torch.randn(5, 8, generator=g) for _ in range(F)]
    ref = OnebitAdamWarmup(start.clone(), lr, F, betas, eps, wd)
    for grad in grads:                               # DeepSpeed: F step() calls before compressing
        ref.step(grad)
    assert ref.adam_steps == F - 1
    p = torch.nn.Parameter(start.clone())
    opt = thinwire.APMSqueeze([p], lr=lr, warmup_steps=F - 1, betas=betas, eps=eps, weight_decay=wd,
                              bias_correction=False)
    for grad in grads[1:]:                           # thinwire: F − 1 step() calls, the same gradients
        p.grad = grad.clone()
        opt.step()
        assert opt.comm_stats.last_step.payload_bytes >= 4 * p.numel()   # still dense (fp32 all-reduce)
    assert torch.allclose(p.detach(), ref.p, rtol=1e-6, atol=1e-7)
    assert torch.allclose(opt.state[p]["exp_avg"], ref.m, rtol=1e-6, atol=1e-8)
    assert torch.allclose(opt.state[p]["exp_avg_sq"], ref.v, rtol=1e-6, atol=1e-10)
    p.grad = grads[0].clone()
    opt.step()                                       # the next step is 1-bit: far fewer bytes
    assert opt.comm_stats.last_step.payload_bytes < p.numel()


# ---- torchft's DiLoCo: its outer SGD(nesterov=True) is outer_lr, outer_momentum --------------

def test_torchft_diloco_with_nesterov_sgd_outer_is_thinwire_diloco():
    H_, syncs, inner_lr, outer_lr, mu = 3, 3, 0.02, 0.7, 0.9
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    noises = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(H_ * syncs)]

    # torchft's procedure, one replica (its all-reduce averages over one participant)
    ref = [torch.nn.Parameter(p.clone()) for p in start]
    inner = torch.optim.AdamW(ref, lr=inner_lr)
    outer = torch.optim.SGD(ref, lr=outer_lr, momentum=mu, nesterov=True)
    original = [p.detach().clone() for p in ref]
    for step in range(H_ * syncs):
        for p, n in zip(ref, noises[step]):
            p.grad = _grad(p.detach(), n)
        inner.step()
        if (step + 1) % H_ == 0:
            with torch.no_grad():
                for p, o in zip(ref, original):
                    p.grad = o - p                       # pseudo-gradient: original − local
                    p.copy_(o)                           # restore, then the outer step
            outer.step()
            original = [p.detach().clone() for p in ref]

    ours = [torch.nn.Parameter(p.clone()) for p in start]
    opt = thinwire.DiLoCo(ours, inner=lambda ps: torch.optim.AdamW(ps, lr=inner_lr), sync_every=H_,
                          outer_lr=outer_lr, outer_momentum=mu)
    for step in range(H_ * syncs):
        for p, n in zip(ours, noises[step]):
            p.grad = _grad(p.detach(), n)
        opt.step()
    for p, q in zip(ours, ref):
        assert torch.allclose(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert not any(torch.equal(p.detach(), s) for p, s in zip(ours, start))
    assert math.isfinite(float(sum(p.detach().sum() for p in ours)))
