"""A small regression problem whose shapes exercise chunking, padding and 1-D parameters.

Student MLP 24 -> 37 -> 10 (37 is prime, so with chunk=16 it is padded to 48) regresses a
fixed random teacher. Every (rank, step) draws its own batch from its own seed, so ranks
see different data, yet every run is reproducible.
"""

from __future__ import annotations

import torch

IN, HIDDEN, OUT, BATCH = 24, 37, 10, 32


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


_TEACHER: tuple[torch.nn.Module, torch.Tensor] | None = None


def _teacher() -> torch.nn.Module:
    """The teacher, built once per process (seed 1234), and the global CPU generator left where
    building it leaves it, as every call did when each built its own: code that draws from the
    global generator after a batch() sees the same numbers. batch() asks for it every step, and
    torch.manual_seed (with torch.cuda not initialised) formats the caller's whole stack three
    times, for lazy CUDA/XPU/MTIA seeding: ~4 ms a call at pytest's depth, thousands of calls."""
    global _TEACHER
    if _TEACHER is None:
        torch.manual_seed(1234)
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
        for p in model.parameters():
            p.requires_grad_(False)    # only ever evaluated under no_grad; read only (a shared copy)
        _TEACHER = model, torch.get_rng_state()
    model, state = _TEACHER
    torch.set_rng_state(state)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(BATCH, IN, generator=gen)
    with torch.no_grad():
        y = _teacher()(x)
    return x, y


def loss_on(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def eval_loss(model: torch.nn.Module) -> float:
    gen = torch.Generator().manual_seed(999_999)
    x = torch.randn(512, IN, generator=gen)
    with torch.no_grad():
        return float(loss_on(model, x, _teacher()(x)))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
