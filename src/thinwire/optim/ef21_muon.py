"""EF21-Muon: Muon with EF21 error feedback on both links (Gruntkowska et al., arXiv 2510.00643).

Per parameter, each step, with W the parameter itself, n ranks, t = lr, C_j = `uplink`,
C = `downlink`, the LMO chosen by the param group's `lmo`:

    worker j:  M_j ← (1 − β) M_j + β ∇f_j(W)          (M_j.lerp_(grad, β), as torch's Muon)
               R_j = C_j(M_j − G_j);   G_j ← G_j + R_j   (the R_j the wire delivers)
    server:    G ← G + (1/n) Σ_j R_j                    (summed in rank order)
               X ← (1 − tλ) X + t · LMO(G)              (λ = weight_decay, decoupled)
               S = C(X − W)
    everyone:  W ← W + S

LMOs (radius t is the group's lr): 'spectral' (Muon) LMO(G) = −√max(1, rows/cols) ·
NS(G), NS = 5 quintic Newton–Schulz steps (`thinwire.ops.orthogonalize`, conv weights
flattened to out × in·kh·kw); 'sign' (ℓ∞ ball, Scion/Gluon's choice for embeddings and
the output head) −sign(G); 'rms' (RMS-norm ball, their choice for biases and gains)
−√d · G / ‖G‖₂; 'auto' (default) is spectral for ≥2-D tensors and rms otherwise.

Initialisation (the first-step convention): M_j = G_j = G = 0 and X = W = the initial
parameters. The paper's iteration starts with X¹ = LMO step from G⁰; with G⁰ = 0 that step
moves nothing, so each `step()` is the worker half with the gradient at the current W
followed by the server half. Then M¹ = β∇f(W⁰), exactly torch.optim.Muon's zero-initialised
buffer after `buf.lerp_(grad, 1 − momentum)`, which is what makes the identity case Muon.

Lossless links (the 'identity' compressor in fp32) send the new state itself instead of
the difference: M_j up (so G_j ← M_j, G ← (1/n) Σ_j M_j) and X down (W ← X). In exact
arithmetic that is the same as adding R_j and S; in floating point it avoids
(M − G) + G ≠ M, so with one rank EF21Muon(lr=t, beta=b, uplink='identity',
downlink='identity') reproduces torch.optim.Muon(lr=t, momentum=1 − b, nesterov=False,
adjust_lr_fn='original') bit for bit (whenever 1 − (1 − b) == b in floating point).

Topologies: 'server' — rank 0 is also the server: one `gather` of the uplink messages to
rank 0, which alone holds G and X, and one `broadcast` of the compressed S. 'replicated' —
one `all_gather`; every rank runs the server step identically (deterministic, rank order)
and applies S itself, so there is no downlink traffic but W still moves only by C(X − W).
Both give the same W bit for bit. Comm stats tag the uplink 'payload' and the downlink
'downlink'. Each message starts with the 8-byte protocol header; rank 0 relays a verdict
(non-finite gradients, bad peers) in the downlink header, so every rank raises together.
Randomised compressors (Rand-K, natural) draw from seeds derived from (seed, step,
parameter index, link, sender rank), so receivers regenerate the same indices.

    opt = EF21Muon(model.parameters(), lr=0.02, beta=0.05, uplink="topk:0.05+natural")
"""

from __future__ import annotations

import math

import torch

from ..compress.spec import parse_compressor
from ..ops import NS_EPS, muon_scale, orthogonalize
from .base import CommunicatingOptimizer
from .protocol import (FLAG_NONFINITE, HEADER_NBYTES, NonFiniteGradientError, PeerMismatchError, all_finite,
                       check_nonfinite_policy, read_headers, write_header)

LMOS = ("auto", "spectral", "sign", "rms")
TOPOLOGIES = ("server", "replicated")
FLAG_SERVER_ERROR = 2          # downlink header: rank 0 rejected this step's messages


def _check_group(g: dict) -> None:
    if not g["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {g['lr']}")
    if not 0.0 < g["beta"] <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {g['beta']}")
    if g["lmo"] not in LMOS:
        raise ValueError(f"lmo must be one of {LMOS}, got {g['lmo']!r}")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
    for p in g.get("params", []):
        if g["lmo"] == "spectral" and p.dim() < 2:
            raise ValueError(f"lmo='spectral' needs >=2-D parameters, got shape {tuple(p.shape)}; put "
                             "biases and gains in a param group with lmo='rms' or 'sign' (or use 'auto')")


def lmo_step(x: torch.Tensor, g: torch.Tensor, lr: float, lmo: str) -> None:
    """X ← X + t · LMO(G) in place (see the module docstring for each LMO)."""
    if lmo == "auto":
        lmo = "spectral" if g.dim() >= 2 else "rms"
    if lmo == "spectral":
        matrix = g.reshape(g.shape[0], -1)
        # the same add_ (bf16 update into the fp32 tensor) as torch.optim.Muon, for bit equality
        x.add_(orthogonalize(matrix).view(g.shape), alpha=-lr * muon_scale(matrix.shape))
    elif lmo == "sign":
        x.add_(g.sign(), alpha=-lr)
    else:  # rms: G = 0 gives no step (norm clamped like Newton–Schulz's)
        x.sub_(g * (lr * math.sqrt(g.numel()) / g.norm().clamp(min=NS_EPS)))


def _seed(*parts: int) -> int:
    """A deterministic 63-bit mix (FNV-style) of integers; every rank computes the same."""
    h = 0xCBF29CE484222325
    for part in parts:
        h = ((h ^ (int(part) & 0xFFFF_FFFF_FFFF_FFFF)) * 0x100000001B3) & 0xFFFF_FFFF_FFFF_FFFF
    return h & 0x7FFF_FFFF_FFFF_FFFF


class EF21Muon(CommunicatingOptimizer):
    """EF21-Muon; see the module docstring for the equations, topologies and conventions.

    Args:
        lr: step size (LMO radius) t >= 0. beta: momentum weight β in (0, 1] (paper's
            convention; β = 1 − Muon's momentum, 0.05 matches Muon's 0.95).
        lmo: 'auto' | 'spectral' | 'sign' | 'rms', per param group. weight_decay: decoupled λ on X.
        uplink, downlink: compressor object or spec string ('identity', 'topk:0.05',
            'randk:0.05', 'natural', 'rank:4', 'dct-topk:32', 'topk:0.05+natural', ...;
            grammar in `thinwire.compress.spec`) for the worker → server and server →
            worker messages. topology: 'server' | 'replicated'. seed: randomised compressors.
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite; no
            state changes on any rank in that step either way.
        process_group: torch.distributed group (default: world; none needed for one process).
    State per parameter: step, momentum (M_j), estimate (G_j); where the server runs,
    server_estimate (G) and server_model (X). Resume with the same topology (under 'server'
    only rank 0 holds G and X). Parameters should be float32 (keep fp32 master weights under
    mixed precision): W += S accumulates in the parameter's dtype.
    'sign' and 'rms' move each element by about lr per step, like Adam's early updates, so
    such groups take an AdamW-sized lr (e.g. 3e-3), not Muon's 0.02.
    """

    def __init__(self, params, lr: float = 0.02, beta: float = 0.05, lmo: str = "auto", weight_decay: float = 0.0,
                 uplink="topk:0.05", downlink="identity", topology: str = "server", seed: int = 0,
                 nonfinite: str = "raise", process_group=None):
        self.nonfinite = check_nonfinite_policy(nonfinite)
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.uplink, self.downlink = parse_compressor(uplink, "uplink"), parse_compressor(downlink, "downlink")
        self.topology, self.seed = topology, seed
        defaults = dict(lr=lr, beta=beta, lmo=lmo, weight_decay=weight_decay)
        _check_group(defaults)
        super().__init__(params, defaults)
        self._init_comm(process_group)
        self._buffers: dict[str, torch.Tensor] = {}

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_group({**self.defaults, **param_group, "params": params})
        super().add_param_group({**param_group, "params": params})

    @property
    def is_server(self) -> bool:
        return self.topology == "replicated" or self.comm.rank == 0

    def _layout(self):
        """[(group, p, index, up_offset, up_n, down_offset, down_n)] and both message sizes."""
        entries, up, down = [], HEADER_NBYTES, HEADER_NBYTES
        for group in self.param_groups:
            for p in group["params"]:
                nu, nd = self.uplink.payload_nbytes(p.shape), self.downlink.payload_nbytes(p.shape)
                entries.append((group, p, len(entries), up, nu, down, nd))
                up, down = up + nu, down + nd
        return entries, up, down

    def _buffer(self, name: str, nbytes: int, device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != nbytes or buf.device != device:
            buf = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    def _describe(self, entries) -> str:
        lines = [f"world_size={self.comm.world_size} topology={self.topology} seed={self.seed} "
                 f"uplink={self.uplink.name} downlink={self.downlink.name}"]
        lines += [f"{tuple(p.shape)} {p.dtype} lmo={g['lmo']} @{uo}+{un} @{do}+{dn}"
                  for g, p, _, uo, un, do, dn in entries]
        return "\n".join(lines)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._begin_step(closure)
        entries, up_n, down_n = self._layout()
        self._agree(self._describe(entries))
        step = self._advance_step(entries)
        device = entries[0][1].device
        up, down = self._buffer("up", up_n, device), self._buffer("down", down_n, device)
        finite = all_finite(p.grad for _, p, *_ in entries if p.grad is not None)
        write_header(up, step, 0 if finite else FLAG_NONFINITE)
        moments = None
        if finite:
            moments = self._encode_uplink(entries, up, step)
        else:
            up[HEADER_NBYTES:].zero_()
        if self.topology == "replicated":
            gathered = self.comm.all_gather(up, tag="payload")
            bad = read_headers(gathered[:, :HEADER_NBYTES], step).tolist()   # same verdict on every rank
            if not bad:
                self._serve(entries, gathered, down, step)
        else:
            bad = self._relay(entries, up, down, step)
        if bad:
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"non-finite gradients on rank(s) {bad} at step {step}; no state changed on any rank "
                    "(EF21Muon(nonfinite='skip') skips such steps instead)")
            return loss
        self._commit(entries, up, moments, step)
        for group, p, i, _, _, do, dn in entries:                          # W ← W + S
            shift = self.downlink.decode(down[do: do + dn], p.shape, _seed(self.seed, step, i, 0))
            if self.downlink.lossless:
                p.copy_(shift)
            else:
                p.add_(shift.to(p.dtype))
        return loss

    def _relay(self, entries, up, down, step: int) -> list:
        """topology='server': gather to rank 0, server step there, broadcast S with a verdict."""
        gathered = self.comm.gather(up, dst=0, tag="payload")
        error, bad = None, ["reported by rank 0"]        # what non-root ranks can say about a bad step
        if self.comm.rank == 0:
            try:
                bad = read_headers(gathered[:, :HEADER_NBYTES], step).tolist()
                if not bad:
                    self._serve(entries, gathered, down, step)
                write_header(down, step, FLAG_NONFINITE if bad else 0)
            except (PeerMismatchError, ValueError) as err:   # tell the others before raising
                error = err
                write_header(down, step, FLAG_SERVER_ERROR)
        self.comm.broadcast(down, src=0, tag="downlink")
        if error is not None:
            raise error
        if int(down[2]) & FLAG_SERVER_ERROR:
            raise PeerMismatchError(f"rank 0 (the server) rejected the messages of step {step}; "
                                    "its error names the cause")
        flagged = read_headers(down[None, :HEADER_NBYTES], step).tolist()
        return bad if flagged else []

    def _advance_step(self, entries) -> int:
        for _, p, *_ in entries:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["estimate"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.is_server and "server_model" not in state:
                state["server_estimate"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["server_model"] = p.detach().clone(memory_format=torch.preserve_format)
            state["step"] += 1
        return self.state[entries[0][1]]["step"]

    def _encode_uplink(self, entries, up, step: int) -> list:
        """New momenta (not yet committed) and their messages R_j (or M_j if lossless) in `up`."""
        moments, rank = [], self.comm.rank
        for group, p, i, uo, un, *_ in entries:
            state = self.state[p]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            m = state["momentum"].lerp(grad, group["beta"])
            message = m if self.uplink.lossless else m - state["estimate"]
            self.uplink.encode(message, up[uo: uo + un], _seed(self.seed, step, i, 1, rank))
            moments.append(m)
        return moments

    def _commit(self, entries, up, moments, step: int) -> None:
        """The step is good on every rank: M_j ← new momentum, G_j ← G_j + R_j (as sent)."""
        for (group, p, i, uo, un, *_), m in zip(entries, moments):
            state = self.state[p]
            state["momentum"].copy_(m)
            if self.uplink.lossless:
                state["estimate"].copy_(m)
            else:
                sent = self.uplink.decode(up[uo: uo + un], p.shape, _seed(self.seed, step, i, 1, self.comm.rank))
                state["estimate"].add_(sent.to(p.dtype))

    def _serve(self, entries, gathered, down, step: int) -> None:
        """Server step for every parameter: G, X, and S = C(X − W) into `down`."""
        world = gathered.shape[0]
        for group, p, i, uo, un, do, dn in entries:
            state = self.state[p]
            total = None
            for r in range(world):                                   # rank order: same sum everywhere
                part = self.uplink.decode(gathered[r, uo: uo + un], p.shape, _seed(self.seed, step, i, 1, r))
                total = part if total is None else total.add_(part)
            mean = total.div_(world).to(p.dtype)
            if self.uplink.lossless:
                state["server_estimate"].copy_(mean)
            else:
                state["server_estimate"].add_(mean)
            x = state["server_model"]
            if group["weight_decay"]:
                x.mul_(1.0 - group["lr"] * group["weight_decay"])
            lmo_step(x, state["server_estimate"], group["lr"], group["lmo"])
            shift = x if self.downlink.lossless else x - p
            self.downlink.encode(shift, down[do: do + dn], _seed(self.seed, step, i, 0))
