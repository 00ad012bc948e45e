"""APMSqueeze: Adam-preconditioned momentum SGD with 1-bit compressed momentum after an Adam
warmup (Tang et al., arXiv 2008.11343; DeepSpeed's OnebitAdam is its production form).

Every rank i, step t (g_i: this rank's gradient; W ranks; λ: decoupled weight decay):

  warmup, t <= T_w (dense: one fp32 all-reduce of all gradients per step):
      g = (1/W) Σ_j g_j
      m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²
      θ ← θ (1 − η λ) − η m̂ / (sqrt(v̂) + ε)      m̂ = m / (1 − β1^t), v̂ = v / (1 − β2^t)
    (exactly torch.optim.AdamW on the averaged gradient); after step T_w, v is frozen.
  compressed, t > T_w (`thinwire.comm.collectives.compressed_allreduce`, two collectives):
      m_i = β1 m̄ + (1 − β1) g_i                   from the shared m̄ of the previous step
      m̄ = C[(1/W) Σ_j C[m_j + δ_j] + δ̄]           δ_i ← what this rank's C lost,
                                                   δ̄ ← what this server chunk's C lost
      θ ← θ (1 − η λ) − η m̄ / (1 − β1^t) / (sqrt(v_{T_w} / (1 − β2^{T_w})) + ε)
  C: sign × RMS scale (||x||_2 / sqrt(n)) per chunk of N / W elements, N the flat length of
  all parameters padded to a multiple of 8W; exact zeros are sent as +scale (see onebit).

Paper and DeepSpeed apply no bias correction; with bias_correction=True (default) the
compressed phase with lossless C is exactly Adam with v frozen, so the switch at T_w makes
no jump in step size; bias_correction=False gives the paper's m / (sqrt(v) + ε) in both
phases. Coordinates with v_{T_w} = 0 are not moved by m̄ (see mask_unseen). Non-finite gradients or momenta raise NonFiniteGradientError on every rank in the
same step, before any state changes. Unlike DeepSpeed, `state_dict()` keeps this rank's
worker and server errors (and the world size and rank they belong to), so a resume on the
same ranks continues bit-identically; see `error_resume` for a different world.

    opt = APMSqueeze(model.parameters(), lr=1e-3, warmup_steps=total_steps // 5)
    loss.backward(); opt.step(); opt.zero_grad()     # no DDP gradient all-reduce
"""

from __future__ import annotations

import math
import warnings

import torch

from ..comm.collectives import compressed_allreduce, padded_numel
from .base import CommunicatingOptimizer, flatten_grads
from .protocol import (FLAG_NONFINITE, HEADER_NBYTES, NonFiniteGradientError, all_finite,
                       read_headers, write_header)

ERRORS_KEY = "apmsqueeze"
ERROR_RESUME = ("exact", "reset")
COMPRESS = ("momentum", "preconditioned")


def _check_group(g: dict) -> None:
    """ValueError naming the first invalid hyperparameter of a param group."""
    if not g["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {g['lr']}")
    betas = g["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not g["eps"] > 0.0:
        raise ValueError(f"eps must be > 0, got {g['eps']}")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")


class APMSqueeze(CommunicatingOptimizer):
    """Adam for `warmup_steps`, then 1-bit compressed momentum with frozen v (module docstring).

    Args:
        lr: η. warmup_steps: T_w >= 0, dense Adam steps before v freezes (15-25 % of training
            is DeepSpeed's advice; 0 means v stays 0, i.e. steps of m / ε).
        betas: (β1, β2) in [0, 1). eps: ε > 0. weight_decay: decoupled λ (AdamW style).
        bias_correction: Adam's 1 / (1 − β^t) factors (default True; False: the paper's equations).
        mask_unseen: coordinates whose frozen v is exactly 0 (no rank ever had a gradient there
            during warmup, e.g. embedding rows of tokens not yet seen) get no momentum update in
            the compressed phase (default True). The 1-bit m̄ gives every coordinate a magnitude
            of its chunk's scale, and m̄ / (0 + ε) would throw such parameters to ~lr·s/ε (they
            blow up once the token appears). DeepSpeed leaves this to a user-given exp_avg_mask;
            False gives the paper's update everywhere. Weight decay still applies there.
        error_resume: what load_state_dict does with error buffers saved by another world size
            or rank: 'exact' (default) raises ValueError; 'reset' zeroes them with a warning.
        process_group: torch.distributed group (default: world; none needed for one process).
    Gradients that are None count as zero. warmup_steps is global: the phase decides the
    collective, so every rank switches at the same step.
    """

    def __init__(self, params, lr: float, warmup_steps: int, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, process_group=None, bias_correction: bool = True,
                 mask_unseen: bool = True, compress: str = "momentum", error_resume: str = "exact"):
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if error_resume not in ERROR_RESUME:
            raise ValueError(f"error_resume must be one of {ERROR_RESUME}, got {error_resume!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        _check_group(defaults)
        super().__init__(params, defaults)
        self.warmup_steps, self.bias_correction, self.error_resume = warmup_steps, bool(bias_correction), error_resume
        if compress not in COMPRESS:
            raise ValueError(f"compress must be one of {COMPRESS}, got {compress!r}")
        self.mask_unseen, self.compress = bool(mask_unseen), compress
        self._init_comm(process_group)
        self.worker_error: torch.Tensor | None = None    # [N] float32, this rank's δ_i
        self.server_error: torch.Tensor | None = None    # [N / W] float32, this rank's chunk's δ̄
        self._workspace: dict = {}                       # reused buffers (not state)
        self._denoms: dict = {}                          # p -> (settings, sqrt(v̂_Tw) + ε): v is frozen

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @property
    def steps_done(self) -> int:
        state = self.state.get(self.params[0], {})
        return int(state.get("step", 0))

    @property
    def phase(self) -> str:
        return "warmup" if self.steps_done < self.warmup_steps else "compressed"

    def state_dict(self):
        state = super().state_dict()
        state[ERRORS_KEY] = {"worker_error": self.worker_error, "server_error": self.server_error,
                             "world_size": self.comm.world_size, "rank": self.comm.rank, "phase": self.phase,
                             "warmup_steps": self.warmup_steps}
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop(ERRORS_KEY, None)
        super().load_state_dict(state_dict)
        self.worker_error = self.server_error = None
        self._denoms.clear()
        self._agreed = None                  # handshake again, with the loaded step, before talking
        if saved is None or saved["worker_error"] is None:
            return
        here = (self.comm.world_size, self.comm.rank)
        if (saved["world_size"], saved["rank"]) != here:
            message = (f"this APMSqueeze state holds the error-feedback buffers of rank {saved['rank']} of "
                       f"{saved['world_size']}, but this is rank {here[1]} of {here[0]}; load each rank's "
                       "own state_dict on the same world size")
            if self.error_resume == "exact":
                raise ValueError(message + ", or pass error_resume='reset' to restart the errors from zero")
            warnings.warn(message + "; error_resume='reset': worker and server errors restart from zero")
            return
        self.worker_error = saved["worker_error"].to(torch.float32).clone()
        self.server_error = saved["server_error"].to(torch.float32).clone()

    def _describe(self, params) -> str:
        """The layout peers must share; the handshake also carries the step (checked after a load)."""
        return f"world_size={self.comm.world_size} warmup={self.warmup_steps} " + " ".join(
            f"{tuple(p.shape)}:{p.dtype}" for p in params)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._begin_step(closure)
        params = self.params
        self._agree(self._describe(params), f"step={self.steps_done}")
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        t = self.steps_done + 1
        if t <= self.warmup_steps:
            self._warmup_step(params, t)
        else:
            self._compressed_step(params, t)
        for p in params:                     # only reached when no rank raised
            self.state[p]["step"] = t
        return loss

    def _entries(self):
        """(group, p, offset) in group order: each parameter's place in the flat buffers."""
        offset = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p, offset
                offset += p.numel()

    def _warmup_step(self, params, t: int) -> None:
        flat = self._workspace["grads"] = flatten_grads(params, self._workspace.get("grads"), torch.float32)
        self.comm.all_reduce(flat)           # every rank sees the same sum: NaN/inf anywhere shows
        if not bool(torch.isfinite(flat).all()):
            raise NonFiniteGradientError(f"non-finite averaged gradient at step {t} (warmup): some rank's "
                                         "gradients are not finite; no parameter was updated on any rank")
        flat.div_(self.comm.world_size)
        for group, p, off in self._entries():
            grad = flat[off: off + p.numel()].view(p.shape).to(p.dtype)
            state, (beta1, beta2) = self.state[p], group["betas"]
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            self._update(p, group, state["exp_avg"], t, t)

    def _update(self, p, group, m: torch.Tensor, t: int, t_v: int) -> None:
        """θ ← θ (1 − η λ) − η m̂ / (sqrt(v̂) + ε), v̂ corrected for its own step count t_v."""
        lr, beta1 = group["lr"], group["betas"][0]
        step_size = lr / (1 - beta1 ** t) if self.bias_correction else lr
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        p.addcdiv_(m.to(p.dtype), self._denominator(p, group, t_v), value=-step_size)

    def _denominator(self, p, group, t_v: int) -> torch.Tensor:
        """sqrt(v / (1 − β2^t_v)) + ε, computed as torch.optim.Adam does; once v is frozen it is
        cached, and with mask_unseen it is +inf where v_Tw == 0, so m̄ moves nothing there."""
        beta2, eps = group["betas"][1], group["eps"]
        frozen = self.steps_done >= self.warmup_steps
        key = (t_v, beta2, eps, self.bias_correction, self.mask_unseen)
        cached = self._denoms.get(p)
        if frozen and cached is not None and cached[0] == key:
            return cached[1]
        v = self.state[p]["exp_avg_sq"]
        v_scale = math.sqrt(1 - beta2 ** t_v) if self.bias_correction and t_v > 0 else 1.0
        denom = (v.sqrt() / v_scale).add_(eps)
        if frozen:                               # compressed phase: v and t_v no longer change
            if self.mask_unseen:
                denom.masked_fill_(v == 0, math.inf)
            self._denoms[p] = (key, denom)
        return denom

    def _compressed_step(self, params, t: int) -> None:
        world, dev = self.comm.world_size, params[0].device
        numel = sum(p.numel() for p in params)
        n = padded_numel(numel, world)
        if self.worker_error is None or self.worker_error.numel() != n:
            # first compressed step (or a changed layout, whose old errors no longer line up)
            self.worker_error = torch.zeros(n, dtype=torch.float32, device=dev)
            self.server_error = torch.zeros(n // world, dtype=torch.float32, device=dev)
        self._workspace.pop("grads", None)              # the warmup's gradient buffer is done with
        x = self._workspace.get("x")
        if x is None or x.numel() != n:
            x = self._workspace["x"] = torch.empty(n, dtype=torch.float32, device=dev)
        x[numel:].zero_()                                # padding: zeros (m̄ was decoded into it)
        for group, p, off in self._entries():           # m_i = β1 m̄ + (1 − β1) g_i
            view = x[off: off + p.numel()].view(p.shape)
            torch.mul(self.state[p]["exp_avg"], group["betas"][0], out=view)
            if p.grad is not None:
                view.add_(p.grad, alpha=1 - group["betas"][0])
            if self.compress == "preconditioned":                     # u_i = m_i / (sqrt(v̂) + ε)
                view.div_(self._denominator(p, group, self.warmup_steps))
        header = torch.empty(HEADER_NBYTES, dtype=torch.uint8)
        write_header(header, t, 0 if all_finite([x, self.worker_error]) else FLAG_NONFINITE)

        def check(headers: torch.Tensor) -> None:
            bad = read_headers(headers, t).tolist()
            if bad:
                raise NonFiniteGradientError(f"non-finite momentum on rank(s) {bad} at step {t}; no parameter "
                                             "or state was updated on any rank")

        m_bar = compressed_allreduce(self.comm, x, self.worker_error, self.server_error, header=header.to(dev),
                                     check=check, workspace=self._workspace, out=x)    # errors updated in place
        for group, p, off in self._entries():
            state = self.state[p]
            state["exp_avg"].copy_(m_bar[off: off + p.numel()].view(p.shape))   # m ← m̄, shared
            if self.compress == "preconditioned":                     # m̄ = ū (sqrt(v̂) + ε); 0 where masked
                state["exp_avg"].mul_(self._denominator(p, group, self.warmup_steps)).nan_to_num_(0.0, 0.0, 0.0)
            self._update(p, group, state["exp_avg"], t, self.warmup_steps)
