"""DeMo: decoupled momentum optimisation (Peng et al., arXiv 2411.19870, ICLR 2026).

Per parameter, on every rank i, each step t (equations of the paper, in the arithmetic of
the reference implementation bloc97/DeMo):

    θ ← θ (1 − η λ)                                  decoupled weight decay
    M_i ← β M_i + η g_i                              local momentum (η inside, as the reference)
    Q_i = Top-k per chunk of T(M_i)                  T: chunked orthonormal transform
    M_i ← M_i − α T⁻¹(Q̂_i)                          momentum subtraction = error feedback;
                                                     Q̂_i is Q_i as the wire delivers it, so
                                                     value quantisation loss stays in M_i
    Δ = T⁻¹( mean_j Q̂_j )                           all ranks' messages, one all-gather per step
    θ ← θ − η φ(Δ)                                   φ: sign (signum), NS-orthogonalise (muon)
    θ ← θ − Δ                                        φ = identity (sgd): η is already inside M

With transform='dct', alpha=1, base='signum', values='fp32' and one worker this is the
reference's arithmetic step for step (momentum_domain='param' operation by operation; the
default keeps T(M) instead, which agrees to float rounding). Differences from the
reference, each for a reason: the aggregate averages over all ranks (aggregate='senders' gives the reference's
mean-over-senders); a dimension with no divisor in [chunk/2, chunk] is zero-padded rather
than chunked by 1; indices travel bit-packed and values in `values` precision; all
parameters share one all-gather; the momentum lives in `self.state[p]['momentum']`.

    opt = DeMo(model.parameters(), lr=3e-4, topk=32)
    loss.backward(); opt.step(); opt.zero_grad()     # no DDP gradient all-reduce
"""

from __future__ import annotations

import torch

from ..compress import AGGREGATIONS, TRANSFORMS, ChunkedTopK, Payload
from ..ops import muon_scale, orthogonalize
from .base import CommunicatingOptimizer
from .protocol import (HEADER_NBYTES, FLAG_NONFINITE, NonFiniteGradientError, all_finite,
                       check_nonfinite_policy, read_headers, write_header)

BASES = ("signum", "sgd", "muon")
VALUES = ("fp32", "bf16", "int8", "sign")
DOMAINS = ("auto", "param", "transform")
_WIRE_KEYS = ("topk", "chunk", "transform", "values", "seed", "aggregate", "base", "momentum_domain")


def _check_group(g: dict) -> None:
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
    for name, valid in (("transform", TRANSFORMS), ("base", BASES), ("values", VALUES),
                        ("aggregate", AGGREGATIONS), ("momentum_domain", DOMAINS)):
        if g[name] not in valid:
            raise ValueError(f"{name} must be one of {valid}, got {g[name]!r}")
    if g["momentum_domain"] == "transform" and g["transform"] == "random":
        raise ValueError("momentum_domain='transform' needs a fixed basis: transform must be 'dct' or 'identity'")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")


def momentum_in_transform(group: dict) -> bool:
    """Whether the group keeps M as transform coefficients (momentum_domain, 'auto' resolved)."""
    domain = group["momentum_domain"]
    return domain == "transform" or (domain == "auto" and group["transform"] != "random")


def _check_momentum(m: torch.Tensor, p: torch.Tensor, comp: ChunkedTopK, group: dict) -> None:
    """A loaded momentum must have this group's layout: a state_dict from another
    momentum_domain or chunk size would otherwise be misread, not rejected."""
    plan = comp.plan(p.shape)
    expected = (plan.padded_rows, plan.padded_cols) if momentum_in_transform(group) else tuple(p.shape)
    if tuple(m.shape) != expected:
        raise ValueError(f"momentum of a {tuple(p.shape)} parameter has shape {tuple(m.shape)}, expected "
                         f"{expected} for momentum_domain={group['momentum_domain']!r}, chunk={group['chunk']}: "
                         "was the state_dict saved with other settings?")


def apply_base(p: torch.Tensor, delta: torch.Tensor, lr: float, base: str) -> None:
    """θ ← θ − η φ(Δ) (or θ ← θ − Δ for sgd, whose momentum already carries η)."""
    if base == "sgd":
        p.sub_(delta.to(p.dtype))
    elif base == "muon" and p.dim() >= 2:
        matrix = delta.reshape(p.shape[0], -1)                 # conv (o, i, kh, kw) -> (o, i*kh*kw)
        update = orthogonalize(matrix).view(p.shape).to(p.dtype)
        p.add_(update, alpha=-lr * muon_scale(matrix.shape))
    else:  # signum, and muon's fallback for vectors and scalars
        p.add_(delta.sign_().to(p.dtype), alpha=-lr)            # delta is ours: sign it in place


class DeMo(CommunicatingOptimizer):
    """Decoupled momentum: each rank sends the top-k chunked-transform coefficients of its
    momentum; see the module docstring for the equations.

    Args:
        lr: step size η. beta: momentum decay β in [0, 1). alpha: momentum subtraction α in (0, 1].
        topk: coefficients kept per chunk. chunk: target chunk side (64 → 64×64 chunks).
        transform: 'dct' | 'random' (Haar basis redrawn each step from `seed`) | 'identity'.
        base: φ — 'signum' | 'sgd' | 'muon' (Newton–Schulz on ≥2-D, sign on vectors).
        weight_decay: decoupled λ. values: wire precision — 'fp32' | 'bf16' | 'int8' | 'sign'.
        aggregate: 'mean' over ranks, or 'senders' (the reference's mean over ranks that sent
            a coefficient). seed: shared seed of the random transform.
        momentum_domain: 'auto' (default: 'transform' for the fixed bases 'dct' and
            'identity', 'param' for 'random'), 'param' (the reference's arithmetic, M has the
            parameter's shape and dtype) or 'transform': M is kept as its chunk coefficients
            T(M) (float32, in image layout: the padded matrix [R, C] with coefficient (u, v)
            of chunk (a, b) at [a*h + u, b*w + v]), which is the same algorithm since T is
            linear and fixed, but saves the inverse transform of the sent part and the
            forward transform of M each step (the gradient is transformed instead, and the
            decay folds into that GEMM). Needs transform 'dct' or 'identity'.
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite; in
            both cases no parameter moves that step, on any rank, and healthy ranks keep the
            step's gradient in their momentum (to be sent later).
        process_group: torch.distributed group (default: world; none needed for one process).
    Gradients that are None count as zero, so every rank sends the same layout.
    """

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.999, alpha: float = 1.0, topk: int = 32,
                 chunk: int = 64, transform: str = "dct", base: str = "signum", weight_decay: float = 0.0,
                 values: str = "bf16", aggregate: str = "mean", momentum_domain: str = "auto", seed: int = 0,
                 nonfinite: str = "raise", process_group=None):
        self.nonfinite = check_nonfinite_policy(nonfinite)
        defaults = dict(lr=lr, beta=beta, alpha=alpha, topk=topk, chunk=chunk, transform=transform, base=base,
                        weight_decay=weight_decay, values=values, aggregate=aggregate,
                        momentum_domain=momentum_domain, seed=seed)
        _check_group(defaults)
        super().__init__(params, defaults)
        self._init_comm(process_group)
        self._compressors: dict[tuple, ChunkedTopK] = {}
        self._send: torch.Tensor | None = None   # reused message buffer
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None   # reused transform scratch

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def compressor(self, group: dict) -> ChunkedTopK:
        key = tuple(group[k] for k in ("topk", "chunk", "transform", "values", "seed"))
        key = (int(key[0]), int(key[1]), *key[2:])
        if key not in self._compressors:
            self._compressors[key] = ChunkedTopK(*key)
        return self._compressors[key]

    def _layout(self) -> tuple[list, int]:
        """[(group, p, compressor, offset, nbytes)] in group order, and the message size."""
        entries, offset = [], HEADER_NBYTES
        for group in self.param_groups:
            comp = self.compressor(group)
            for p in group["params"]:
                n = comp.payload_nbytes(p.shape)
                entries.append((group, p, comp, offset, n))
                offset += n
        return entries, offset

    def _describe(self, entries) -> str:
        lines = [f"world_size={self.comm.world_size}"]
        for group, p, _, offset, n in entries:
            wire = ",".join(f"{k}={group[k]}" for k in _WIRE_KEYS)
            lines.append(f"{tuple(p.shape)} {p.dtype} {wire} @{offset}+{n}")
        return "\n".join(lines)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._begin_step(closure)
        entries, nbytes = self._layout()
        description = self._describe(entries)
        self._agree(description)
        if self._send is None or self._send.numel() != nbytes:
            self._send = torch.empty(nbytes, dtype=torch.uint8, device=entries[0][1].device)
        step = self._advance_step(entries)
        finite = all_finite(p.grad for _, p, *_ in entries if p.grad is not None)
        write_header(self._send, step, 0 if finite else FLAG_NONFINITE)
        if finite:
            self._encode(entries, step)
        else:
            self._send[HEADER_NBYTES:].zero_()
        gathered = self.comm.all_gather(self._send)                     # [world, nbytes]
        bad_ranks = read_headers(gathered[:, :HEADER_NBYTES], step).tolist()
        if bad_ranks:
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"non-finite gradients on rank(s) {bad_ranks} at step {step}; no parameter was "
                    "updated on any rank (DeMo(nonfinite='skip') skips such steps instead)")
            return loss
        self._apply(entries, gathered, step)
        return loss

    def _advance_step(self, entries) -> int:
        for group, p, comp, *_ in entries:
            state = self.state[p]
            if not state:
                state["step"] = 0
                if momentum_in_transform(group):
                    plan = comp.plan(p.shape)                   # coefficients in image layout, padding included
                    state["momentum"] = torch.zeros(plan.padded_rows, plan.padded_cols, device=p.device)
                else:
                    state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            _check_momentum(state["momentum"], p, comp, group)
            state["step"] += 1
        return self.state[entries[0][1]]["step"]

    def _scratch(self, entries) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat float32 buffers, each the size of the largest padded parameter, kept
        across steps: the transforms' intermediates go there instead of fresh tensors."""
        numel = max(comp.plan(p.shape).padded_numel for _, p, comp, *_ in entries)
        device = entries[0][1].device
        if self._buffers is None or self._buffers[0].numel() < numel or self._buffers[0].device != device:
            self._buffers = tuple(torch.empty(numel, device=device) for _ in range(2))
        return self._buffers

    def _encode(self, entries, step: int) -> None:
        """M ← βM + ηg, then write each parameter's top-k payload into the message buffer."""
        a, b = self._scratch(entries)
        for group, p, comp, offset, n in entries:
            m, plan, out = self.state[p]["momentum"], comp.plan(p.shape), self._send[offset: offset + n]
            beta, lr = group["beta"], group["lr"]
            if momentum_in_transform(group):                # T is linear: T(βM + ηg) = βT(M) + ηT(g)
                if p.grad is None:
                    m.mul_(beta)
                else:                                       # one batched GEMM does the decay and the add
                    comp.transform.forward_image(plan.transform_input(p.grad, a), plan, step, out=m, scratch=b,
                                                 beta=beta, alpha=lr)
                comp.write(comp.select(m, p.shape, scratch=a), p.shape, out=out)
                continue
            m.mul_(beta)
            if p.grad is not None:
                m.add_(p.grad, alpha=lr)
            image = comp.transform.forward_image(plan.transform_input(m, a), plan, step, out=plan.matrix_in(a), scratch=b)
            comp.write(comp.select(image, p.shape, scratch=b), p.shape, out=out)

    def _apply(self, entries, gathered: torch.Tensor, step: int) -> None:
        a, b = self._scratch(entries)
        for group, p, comp, offset, n in entries:
            spec = comp.payload_spec(p.shape)
            reads = [comp.read(Payload.from_buffer(gathered[r, offset: offset + n], spec), p.shape)
                     for r in range(gathered.shape[0])]                       # validated, rank order
            # M ← M − α·(what the wire delivered of this rank's message)
            m, own = self.state[p]["momentum"], reads[self.comm.rank]
            if momentum_in_transform(group):
                comp.scatter(m, own, p.shape, alpha=-group["alpha"])       # sparse: no transform needed
                plan = comp.plan(p.shape)
                if plan.padded:   # what the message puts in the padding is dropped, as the param domain crops it
                    comp.transform.zero_padding_(m, plan, step)
            else:
                m.sub_(comp.aggregate([own], p.shape, step, out=a, scratch=b), alpha=group["alpha"])
            delta = comp.aggregate(reads, p.shape, step, group["aggregate"], out=a, scratch=b)
            if group["weight_decay"]:
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
            apply_base(p, delta, group["lr"], group["base"])
