"""EF21-Muon's server model step, X ← (1 − tλ) X + t · LMO(G), over a family's flat buffers
(`thinwire.optim.ef21_flat`) in a number of launches that does not grow with the number of
tensors, with the per-tensor arithmetic:

    decay     X ← (1 − tλ) X                   one `mul_` per param group (its range of X)
    spectral  X ← X − t √max(1, r/c) NS(G)     one Newton–Schulz per (rows, cols) shape over
                                               the batch of its matrices (`orthogonalize_batch`),
                                               one `_foreach_add_` per (shape, param group)
    sign      X ← X − t sign(G)                one `sign` and one `add_` per param group
    rms       X ← X − t √d G / ‖G‖₂            one `_foreach_norm` of them all, then per (size,
                                               param group) one stack, one scale, one product;
                                               one `_foreach_add_`

A matrix's batch is its stored shape (conv weights as out × in·kh·kw), tall ones transposed as
a view, as `orthogonalize` does: on CPU bit for bit the per-tensor path (`add_lmo_`); on a GPU
a batched GEMM may sum in another order than one matrix's. Sharded parameters (FSDP2) take
`add_lmo_` one by one: spectral and rms gather the whole matrix over the site first.
"""

from __future__ import annotations

import math

import torch

from ..ops import NS_EPS, add_rms_, add_sign_, add_spectral_, muon_scale
from ..ops.newton_schulz import orthogonalize_batch
from .shards import is_sharded, own_rows, whole


def lmo_of(group: dict, p: torch.Tensor) -> str:
    """The group's LMO for p ('auto': spectral for ≥2-D tensors, rms otherwise)."""
    lmo = group["lmo"]
    if lmo == "auto":
        return "spectral" if p.dim() >= 2 else "rms"
    return lmo


def add_lmo_(x: torch.Tensor, g: torch.Tensor, t: float, lmo: str, key: torch.Tensor) -> None:
    """X ← X + t · LMO(G), the LMO of the ball of radius t in the chosen norm, one tensor.
    Under FSDP2 x and g are this rank's rows of parameter `key`: sign is elementwise, on the
    shard; spectral and rms are defined on the whole G, gathered over the site, and x takes its rows."""
    if is_sharded(key) and lmo != "sign":
        step = torch.zeros(key.shape, dtype=x.dtype, device=x.device)
        add_lmo_(step, whole(key, g), t, lmo, step)                # X_whole − X_whole: t · LMO(G)
        x.add_(own_rows(key, step))
        return
    if lmo == "spectral":
        add_spectral_(x, g, -t)                                    # X ← X − t √max(1, rows/cols) NS(G)
    elif lmo == "sign":
        add_sign_(x, g, -t)                                        # X ← X − t sign(G)
    else:
        add_rms_(x, g, -t)                                         # X ← X − t √d G / ‖G‖₂


class LmoPlan:
    """Which LMO each member of a family takes, and their batches (module docstring)."""

    def __init__(self, family, layout):
        self.family = family
        self.spectral: dict[tuple, list[int]] = {}     # (rows, cols) -> family member positions
        self.rms: dict[tuple, list[int]] = {}          # (id(group), numel) -> positions
        self.single: list[int] = []                    # sharded spectral / rms
        self.sign_groups: list[int] = []               # indices into family.groups
        for j, i in enumerate(family.members):
            m = layout[i]
            lmo = lmo_of(m.group, m.param)
            if lmo != "sign" and is_sharded(m.key):
                self.single.append(j)
            elif lmo == "spectral":
                shape = (m.param.shape[0], math.prod(m.param.shape[1:]))
                self.spectral.setdefault(shape, []).append(j)
            elif lmo == "rms":
                self.rms.setdefault((id(m.group), m.param.numel()), []).append(j)
        for n, (group, _, _) in enumerate(family.groups):
            if group["lmo"] == "sign":
                self.sign_groups.append(n)
        self.groups = {j: layout[i].group for j, i in enumerate(family.members)}
        self.rms_order = [j for members in self.rms.values() for j in members]

    def step(self, x: torch.Tensor, g: torch.Tensor, layout) -> None:
        """X ← (1 − tλ) X + t · LMO(G) on the flat buffers x and g (each group's t, λ now)."""
        fam = self.family
        for group, lo, hi in fam.groups:
            if group["weight_decay"]:
                x[lo:hi].mul_(1.0 - group["lr"] * group["weight_decay"])          # X ← (1 − tλ) X
        for n in self.sign_groups:
            group, lo, hi = fam.groups[n]
            x[lo:hi].add_(g[lo:hi].sign(), alpha=-group["lr"])                  # X ← X − t sign(G)
        if self.spectral:
            self._spectral(x, g)
        if self.rms:
            self._rms(x, g)
        for j in self.single:
            m = layout[fam.members[j]]
            add_lmo_(self._view(x, j), self._view(g, j), m.group["lr"], lmo_of(m.group, m.param), m.key)

    def _view(self, flat: torch.Tensor, j: int, matrix: bool = False) -> torch.Tensor:
        s, shape = self.family.spans[j], self.family.shapes[j]
        view = flat[s.start: s.stop]
        return view.view(shape[0], -1) if matrix else view.view(shape)

    def _spectral(self, x: torch.Tensor, g: torch.Tensor) -> None:
        """X ← X − t √max(1, rows/cols) NS(G), one Newton–Schulz per shape."""
        low = g if g.dtype == torch.bfloat16 else g.bfloat16()             # NS runs in bf16, as Muon's
        for shape, members in self.spectral.items():
            batch = torch.stack([self._view(low, j, matrix=True) for j in members])
            ns = orthogonalize_batch(batch)
            if ns.dtype != x.dtype or not ns.is_contiguous():               # exact: added as x.add_ adds bf16;
                ns = ns.to(x.dtype, memory_format=torch.contiguous_format)  # in X's layout (foreach's fast path)
            scale = muon_scale(shape)
            by_group: dict[int, tuple[float, list, list]] = {}
            for b, j in enumerate(members):
                group = self.groups[j]
                entry = by_group.setdefault(id(group), (-group["lr"] * scale, [], []))
                entry[1].append(self._view(x, j, matrix=True))
                entry[2].append(ns[b])
            for alpha, targets, updates in by_group.values():
                torch._foreach_add_(targets, updates, alpha=alpha)

    def _rms(self, x: torch.Tensor, g: torch.Tensor) -> None:
        """X ← X − t √d G / max(‖G‖₂, eps), as `add_rms_`: the factor (t √d)·(1 / norm)."""
        norms = torch._foreach_norm([self._view(g, j) for j in self.rms_order])
        inverse = torch.stack(norms).clamp_(min=NS_EPS).reciprocal_()
        targets, updates, at = [], [], 0
        for (_, d), members in self.rms.items():
            rows = torch.stack([self._view(g, j).reshape(-1) for j in members])          # [R, d]
            alpha = -self.groups[members[0]]["lr"]
            factor = inverse[at: at + len(members)] * (alpha * math.sqrt(d))
            updates += list((rows * factor[:, None]).unbind(0))
            targets += [self._view(x, j).reshape(-1) for j in members]
            at += len(members)
        torch._foreach_add_(targets, updates)
