"""Update rules that several optimizers share, each an in-place step on x.

    spectral   x ← x + α √max(1, rows/cols) NS(G)      Muon's LMO (G as rows × rest)
    sign       x ← x + α sign(G)                          ℓ∞ LMO, Signum
    rms        x ← x + α √d G / ‖G‖₂                      RMS-ball LMO (G = 0: no step)
    moments    m ← β₁ m + (1 − β₁) g                      Adam's moments, as torch.optim.Adam
               v ← β₂ v + (1 − β₂) g²
    adam       D = √(v / (1 − β₂ᵗ)) + ε                   Adam's denominator, as torch.optim.Adam
    nesterov   b ← μ b + g;  x ← x − η (g + μ b)          torch SGD, Nesterov, dampening 0
"""

from __future__ import annotations

import math

import torch

from .newton_schulz import NS_EPS, muon_scale, orthogonalize


def add_spectral_(x: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
    """x ← x + α √max(1, rows/cols) NS(G); conv weights (o, i, kh, kw) as (o, i·kh·kw)."""
    matrix = g.reshape(g.shape[0], -1)                       # [rows, rest]
    # the bf16 NS output is added into x as torch.optim.Muon adds it (bit equality)
    return x.add_(orthogonalize(matrix).view(x.shape), alpha=alpha * muon_scale(matrix.shape))


def add_sign_(x: torch.Tensor, g: torch.Tensor, alpha: float, consume: bool = False) -> torch.Tensor:
    """x ← x + α sign(G). consume=True: G is scratch and becomes sign(G) in place (no
    parameter-sized temporary: on CPU a fresh one per parameter costs its page faults)."""
    return x.add_(g.sign_() if consume else g.sign(), alpha=alpha)


def add_rms_(x: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
    """x ← x + α √d G / ‖G‖₂ (the norm clamped like Newton–Schulz's, so G = 0 gives no step)."""
    return x.add_(g * (alpha * math.sqrt(g.numel()) / g.norm().clamp(min=NS_EPS)))


def adam_moments_(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float) -> None:
    """m ← β₁ m + (1 − β₁) g;  v ← β₂ v + (1 − β₂) g², in place, as torch.optim.Adam updates them."""
    # m ← β₁ m + (1 − β₁) g
    m.lerp_(g, 1 - beta1)
    # v ← β₂ v + (1 − β₂) g²
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def adam_denominator(v: torch.Tensor, bias_correction2: float, eps: float) -> torch.Tensor:
    """D = √(v / bias_correction2) + ε, computed as torch.optim.Adam does: √v / √bc2 + ε."""
    return (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)


def nesterov_outer_(x: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, lr: float,
                    momentum: float) -> torch.Tensor:
    """b ← μ b + g;  x ← x − η (g + μ b) (torch SGD with nesterov=True, dampening 0, b from 0);
    buf None or μ = 0: x ← x − η g."""
    if buf is not None and momentum:
        buf.mul_(momentum).add_(g)                            # b ← μ b + g
        g = g.add(buf, alpha=momentum)                        # g + μ b
    return x.add_(g.to(x.dtype), alpha=-lr)
