"""DiLoCo: H local steps of any optimizer, then an outer Nesterov step on the averaged
pseudo-gradient (Douillard et al., arXiv 2311.08105; torchft `DiLoCo`, OpenDiLoCo).

On every rank, with θ₀ the parameters all ranks agreed on at the last sync (the anchor):

    θ ← inner.step(θ)                               H times, local gradients, no communication
    Δ = mean_ranks (θ₀ − θ)                         pseudo-gradient: one all-reduce, one flat buffer
    b ← μ b + Δ                                     outer momentum (torch SGD, dampening 0)
    θ₀ ← θ₀ − η_out (Δ + μ b)                       Nesterov; defaults η_out = 0.7, μ = 0.9
    θ ← θ₀                                          every rank leaves the sync bit-identical

The inner optimizer's groups are this object's groups (shared), so LR schedulers act on
the inner learning rate. Between syncs replicas differ by design; right after each sync
they are bit-identical. Bytes are counted by the communicator like every optimizer's:
nothing on local steps, the whole model (plus a 12-byte trailer) on sync steps, so the
per-step cost amortised over H is (4 n + 12) / H for fp32.

This module also holds what LoRDO shares with DiLoCo: `DeltaSync` (mean of a flat vector
over ranks with bad-peer checks and optional bf16/int8 compression with error feedback)
and `outer_step`.
"""

from __future__ import annotations

import math

import torch

from ..wire import get_codec
from .base import STATS_KEY, CommunicatingOptimizer
from .protocol import (FLAG_NONFINITE, HEADER_NBYTES, NonFiniteGradientError, PeerMismatchError, all_finite,
                       read_headers, write_header)

WIRES = ("fp32", "bf16", "int8")
INT8_BLOCK = 256        # values per int8 scale
TRAILER = 3             # fp32 all-reduce: [non-finite flags, s, s^2] with s = step mod 256


def check_sync_every(sync_every) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    return sync_every


def check_outer(outer_lr, outer_momentum) -> None:
    if not outer_lr > 0.0:
        raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
    if not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")


class DeltaSync:
    """The mean over ranks of one flat float32 vector, in one collective.

    wire='fp32': all-reduce (sum) of [x, flag, s, s²]; the three trailing floats let every
    rank see, in the same collective, whether any rank's x was non-finite and whether all
    ranks were at the same step (n·Σs² = (Σs)² only when all s are equal; exact in fp32
    for s < 256 and up to 16 ranks). wire='bf16' | 'int8': a compressed sum cannot be
    re-quantised at every ring hop without losing more, so each rank all-gathers an 8-byte
    protocol header plus its encoded x (bf16, or int8 with one fp32 scale per block of 256
    values, zero-padded), and every rank decodes all messages in rank order and sums them
    in float32 in that order: deterministic, so replicas stay bit-identical. What the
    encoding loses is added to `error` (in place), so it is sent at the next sync.
    """

    def __init__(self, comm, wire: str):
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
        self.comm, self.wire = comm, wire
        self.codec = None if wire == "fp32" else get_codec(wire)

    def _grid(self, n: int) -> tuple[int, int]:
        return (math.ceil(n / INT8_BLOCK), INT8_BLOCK) if self.wire == "int8" else (1, n)

    def mean_delta(self, params: list, state: dict, step: int) -> torch.Tensor:
        """mean over ranks of θ − θ₀ (state[p]['anchor']) for all params, one flat float32
        buffer in param order. On a lossy wire each state[p]['sync_error'] keeps what its
        part of the message lost, fed back at the next sync."""
        delta = torch.cat([(p.detach() - state[p]["anchor"]).reshape(-1).float() for p in params])
        if self.wire == "fp32":
            return self.mean(delta, step)
        for p in params:
            state[p].setdefault("sync_error", torch.zeros(p.numel(), device=p.device))
        error = torch.cat([state[p]["sync_error"] for p in params])
        mean = self.mean(delta, step, error)                 # error updated in place
        for p, part in zip(params, error.split([p.numel() for p in params])):
            state[p]["sync_error"].copy_(part)
        return mean

    def mean(self, x: torch.Tensor, step: int, error: torch.Tensor | None = None) -> torch.Tensor:
        if self.wire == "fp32":
            return self._all_reduce(x, step)
        return self._all_gather(x if error is None else x + error, step, error)

    def _all_reduce(self, x: torch.Tensor, step: int) -> torch.Tensor:
        n, s = x.numel(), step % 256
        buf = torch.empty(n + TRAILER, dtype=torch.float32, device=x.device)
        buf[:n].copy_(x)
        buf[n:] = torch.tensor([0.0 if all_finite([x]) else 1.0, s, s * s])
        self.comm.all_reduce(buf)
        bad, s1, s2 = (float(v) for v in buf[n:].double())
        if self.comm.world_size * s2 != s1 * s1:
            raise PeerMismatchError(f"ranks are out of lockstep at the sync of step {step}: "
                                    "were they resumed from different checkpoints?")
        self._raise_if_bad(bad > 0, step, f"{int(bad)} rank(s)")
        mean = buf[:n].div_(self.comm.world_size)
        self._raise_if_bad(not all_finite([mean]), step, "the sum (overflow)")
        return mean

    def _all_gather(self, x: torch.Tensor, step: int, error: torch.Tensor | None) -> torch.Tensor:
        n = x.numel()
        rows, cols = self._grid(n)
        grid = torch.zeros(rows * cols, dtype=torch.float32, device=x.device)
        grid[:n].copy_(x)
        msg = torch.empty(HEADER_NBYTES + self.codec.nbytes(rows, cols), dtype=torch.uint8, device=x.device)
        write_header(msg, step, 0 if all_finite([x]) else FLAG_NONFINITE)
        self.codec.encode(grid.view(rows, cols), out=msg[HEADER_NBYTES:])
        if error is not None:    # keep exactly what the receivers will not see
            sent = self.codec.decode(msg[HEADER_NBYTES:], rows, cols).view(-1)[:n]
            error.copy_(x - sent)
        gathered = self.comm.all_gather(msg)
        bad = read_headers(gathered[:, :HEADER_NBYTES], step).tolist()
        self._raise_if_bad(bool(bad), step, f"rank(s) {bad}")
        total = torch.zeros(n, dtype=torch.float32, device=x.device)
        for r in range(gathered.shape[0]):           # rank order: the same sum on every rank
            total += self.codec.decode(gathered[r, HEADER_NBYTES:], rows, cols).view(-1)[:n]
        mean = total.div_(self.comm.world_size)
        self._raise_if_bad(not all_finite([mean]), step, "the sum (overflow)")
        return mean

    @staticmethod
    def _raise_if_bad(bad: bool, step: int, who: str) -> None:
        if bad:
            raise NonFiniteGradientError(f"non-finite parameter delta from {who} at the sync of step {step}; "
                                         "no parameter was averaged on any rank")


def outer_step(anchor: torch.Tensor, mean_delta: torch.Tensor, buf: torch.Tensor | None,
               lr: float, momentum: float) -> None:
    """θ₀ ← θ₀ − lr (g + μ b), b ← μ b + g, with g = −mean_delta (torch SGD, Nesterov,
    dampening 0, b starting at 0). lr = 1, μ = 0 is plain averaging: θ₀ + mean_delta."""
    g = mean_delta.neg()
    if buf is not None and momentum:
        buf.mul_(momentum).add_(g)
        g = g.add(buf, alpha=momentum)
    anchor.add_(g.to(anchor.dtype), alpha=-lr)


class DiLoCo(CommunicatingOptimizer):
    """DiLoCo over any inner optimizer; see the module docstring for the equations.

    Args:
        inner: callable params -> torch.optim.Optimizer (default: torch.optim.AdamW with its
            defaults, lr 1e-3); it receives `params` as given (tensors or groups).
        sync_every: H, local steps between syncs (default 32; papers use 20-500).
        outer_lr, outer_momentum: Nesterov outer SGD (defaults 0.7 and 0.9, as published).
        wire: 'fp32' (default) | 'bf16' | 'int8' for the pseudo-gradient, with error feedback.
    Initial parameters must be identical on all ranks (as with DDP's broadcast).
    """

    def __init__(self, params, inner=None, sync_every: int = 32, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, wire: str = "fp32", process_group=None):
        self.sync_every = check_sync_every(sync_every)
        check_outer(outer_lr, outer_momentum)
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.inner = torch.optim.AdamW(params) if inner is None else inner(params)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise ValueError(f"inner must build a torch.optim.Optimizer, got {type(self.inner).__name__}")
        super().__init__(self.inner.param_groups, {})    # shared group dicts: schedulers reach inner
        self._init_comm(process_group)
        self.sync = DeltaSync(self.comm, wire)
        self.wire = wire

    def _describe(self) -> str:
        shapes = " ".join(f"{tuple(p.shape)}:{p.dtype}" for p in self.params)
        return (f"diloco world_size={self.comm.world_size} H={self.sync_every} wire={self.wire} "
                f"outer={self.outer_lr},{self.outer_momentum} {shapes}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._begin_step(closure)
        description = self._describe()
        self._agree(description)
        params = self.params
        for p in params:                              # θ₀ is the parameters before the first step
            if "anchor" not in self.state[p]:
                self.state[p].update(anchor=p.detach().clone(), step=0)
        self.inner.step()
        for p in params:
            self.state[p]["step"] += 1
        step = self.state[params[0]]["step"]
        if step % self.sync_every == 0:
            self._sync(params, step)
        return loss

    def _sync(self, params, step: int) -> None:
        mean = self.sync.mean_delta(params, self.state, step)
        offset = 0
        for p in params:
            state, n = self.state[p], p.numel()
            if self.outer_momentum and "outer_momentum" not in state:
                state["outer_momentum"] = torch.zeros(n, device=p.device)
            outer_step(state["anchor"].view(-1), mean[offset: offset + n], state.get("outer_momentum"),
                       self.outer_lr, self.outer_momentum)
            p.copy_(state["anchor"])
            offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        params = self.params
        outer = [{k: v for k, v in self.state[p].items()} for p in params]
        return {"inner": self.inner.state_dict(), "outer": outer, STATS_KEY: self.comm.stats.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        params = self.params
        outer = state_dict.get("outer")
        if outer is None or len(outer) != len(params):
            raise ValueError(f"state_dict holds outer state for {0 if outer is None else len(outer)} "
                             f"parameters, this DiLoCo has {len(params)}")
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups       # re-share the inner's new group dicts
        for p, saved in zip(params, outer):
            self.state[p] = {k: (v.to(p.device).clone() if torch.is_tensor(v) else v) for k, v in saved.items()}
        if STATS_KEY in state_dict:
            self.comm.stats.load_state_dict(state_dict[STATS_KEY])
