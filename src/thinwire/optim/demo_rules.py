"""DeMo's settings and update rules, as free functions (`thinwire.optim.demo` composes them):
argument checks, the momentum's domain and gradient weight, and the parameter update

    θ ← θ(1 − ηλ) − η φ(Δ)     φ: sign (signum), √(rows/cols)·NS (muon), identity (sgd)
"""

from __future__ import annotations

import torch

from ..compress import AGGREGATIONS, TRANSFORMS, ChunkedTopK
from ..ops import add_sign_, add_spectral_
from ..wire import CODEC_NAMES
from .shards import is_sharded, own_rows, whole

BASES = ("signum", "sgd", "muon")
DOMAINS = ("auto", "param", "transform")
MOMENTUM_FORMS = ("ema", "reference")
LOOKAHEADS = ("none", "momentum", "message")


def check_group(g: dict) -> None:
    """ValueError naming the first invalid hyperparameter of a param group."""
    if not g["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {g['lr']}")
    if not 0.0 <= g["beta"] < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {g['beta']}")
    if not 0.0 < g["alpha"] <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {g['alpha']}")
    for name in ("topk", "chunk"):
        value = g[name]
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, valid in (("transform", TRANSFORMS), ("base", BASES), ("values", CODEC_NAMES),
                        ("aggregate", AGGREGATIONS), ("momentum_domain", DOMAINS),
                        ("momentum_form", MOMENTUM_FORMS)):
        if g[name] not in valid:
            raise ValueError(f"{name} must be one of {valid}, got {g[name]!r}")
    if g["values"] == "8bit":                       # its statistics are per row, and DeMo's rows are chunks
        raise ValueError("values='8bit' sends a 256-level table (1,024 bytes) with every row, and DeMo's rows "
                         "are its chunks (topk values each): use 'int8', or '8bit' with SparseLoCo, whose rows are "
                         "whole tensors")
    if g["values"] == "signbit":                    # ±1 on the wire: M − α T⁻¹(Q̂) would subtract unit values
        raise ValueError("values='signbit' carries no magnitude, and DeMo subtracts what the wire delivers from "
                         "its momentum: use 'sign' (a scale per chunk), or thinwire.SignDeMo, which subtracts "
                         "the kept coefficients themselves")
    if g["momentum_domain"] == "transform" and g["transform"] == "random":
        raise ValueError("momentum_domain='transform' needs a fixed basis: transform must be 'dct' or 'identity'")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")


def momentum_in_transform(group: dict) -> bool:
    """Whether the group keeps M as transform coefficients (momentum_domain, 'auto' resolved)."""
    domain = group["momentum_domain"]
    return domain == "transform" or (domain == "auto" and group["transform"] != "random")


def gradient_weight(group: dict) -> float:
    """The weight of g in M ← βM + w·g: 1 − β (the paper's EMA) or η (the reference's)."""
    return group["lr"] if group["momentum_form"] == "reference" else 1.0 - group["beta"]


def check_momentum(m: torch.Tensor, p: torch.Tensor, comp: ChunkedTopK, group: dict) -> None:
    """A loaded momentum must have this group's layout: a state_dict from another
    momentum_domain or chunk size would otherwise be misread, not rejected."""
    plan = comp.plan(p.shape)
    expected = (plan.padded_rows, plan.padded_cols) if momentum_in_transform(group) else tuple(p.shape)
    if tuple(m.shape) != expected:
        raise ValueError(f"momentum of a {tuple(p.shape)} parameter has shape {tuple(m.shape)}, expected "
                         f"{expected} for momentum_domain={group['momentum_domain']!r}, chunk={group['chunk']}: "
                         "was the state_dict saved with other settings?")


def apply_base(p: torch.Tensor, delta: torch.Tensor, group: dict, key: torch.Tensor) -> None:
    """θ ← θ − η φ(Δ); for φ = identity with the reference's momentum form, θ ← θ − Δ.
    Newton–Schulz (base 'muon') runs on the whole Δ of a sharded parameter `key`, gathered
    over its site; sign and identity are elementwise, on the shard."""
    lr, base = group["lr"], group["base"]
    if base == "sgd":
        p.sub_(delta.to(p.dtype), alpha=1.0 if group["momentum_form"] == "reference" else lr)
    elif base == "muon" and p.dim() >= 2:
        if is_sharded(key):                         # NS(Δ) of the whole matrix, our rows of it
            full = torch.zeros(key.shape, dtype=p.dtype, device=p.device)
            add_spectral_(full, whole(key, delta), -lr)
            p.add_(own_rows(key, full))
        else:
            add_spectral_(p, delta, -lr)
    else:  # signum, and muon's fallback for vectors and scalars
        add_sign_(p, delta, -lr, consume=True)        # delta lives in a scratch buffer


def step_param(p: torch.Tensor, delta: torch.Tensor, group: dict, key: torch.Tensor) -> None:
    """θ ← θ(1 − ηλ), then θ ← θ − η φ(Δ) (`apply_base`)."""
    if group["weight_decay"]:
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
    apply_base(p, delta, group, key)
