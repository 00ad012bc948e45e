"""APMSqueeze: Adam-preconditioned momentum SGD with 1-bit compressed momentum after an Adam
warmup (Tang et al., arXiv 2008.11343; DeepSpeed's OnebitAdam is its production form).

Every rank i, step t (g_i: this rank's gradient, 0 where it has none; W ranks; λ: decoupled
weight decay; t counts the steps in which some rank had a gradient for the parameter, as
torch.optim.Adam counts them; T_w: how many of those were warmup steps):

  warmup, steps 1..warmup_steps, at least MIN_WARMUP_STEPS = 5 of them (`ReduceAll`: one fp32
  all-reduce of all gradients):
      g = (1/W) Σ_j g_j
      m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²
      θ ← θ (1 − η λ) − η m̂ / (sqrt(v̂) + ε)      m̂ = m / (1 − β1^t), v̂ = v / (1 − β2^t)
    (torch.optim.AdamW on the averaged gradient, bit for bit with float32 parameters);
    after the warmup, v is frozen.
  compressed, later steps (`OneBitReduce`: `thinwire.comm.collectives.OneBitAllReduce`,
  an all_to_all then an all_gather):
      m_i = β1 m̄ + (1 − β1) g_i                   from the shared m̄ of the previous step
      m̄ = C[(1/W) Σ_j C[m_j + δ_j] + δ̄]           δ_i ← what this rank's C lost,
                                                   δ̄ ← what this server chunk's C lost
      m ← m̄
      θ ← θ (1 − η λ) − η m̄ / (1 − β1^t) / (sqrt(v / (1 − β2^{T_w})) + ε)
  C: sign × RMS scale (||x||_2 / sqrt(n)) per tensor at the worker and per tensor part of a
  chunk of N / W elements at the server (scale='tensor', the default: DeepSpeed's granularity),
  N the flat length of all parameters padded to a multiple of 8W; or per chunk, a scale
  spanning tensors (scale='chunk'); exact zeros are sent as +scale. 'tensor' measured 2.6 %
  lower final loss on the harness's small GPT and 1.3 % on its Llama, for +80-96 bytes a
  step (docs/results/2026-11-27-apmsqueeze-scale.md).

Paper and DeepSpeed apply no bias correction; with bias_correction=True (default) the
compressed phase with lossless C is exactly Adam with v frozen, so the switch at T_w makes
no jump in step size; bias_correction=False gives the paper's m / (sqrt(v) + ε) in both
phases. Coordinates whose frozen sqrt(v̂) is below ε (v = 0 included) are not moved by m̄
(see mask_unseen).

The step envelope (`thinwire.optim.base`) carries the rest: the message prefix (header and
presence bitmap) at the head of every phase-1 chunk, or as the warmup all-reduce's float
trailer; lockstep; the `nonfinite` policy (on a flagged step nothing moves on any rank and
no state changes, error buffers included); a parameter with a gradient on no rank is left
as it was, its share of both error buffers included. Unlike DeepSpeed, `state_dict()` keeps
this rank's worker and server errors (with the world size and rank they belong to), so a
resume on the same ranks continues bit-identically; on another world size, map the ranks'
states with `thinwire.optim.elastic.remap` (or see `error_resume`).

    opt = APMSqueeze(model.parameters(), lr=1e-3, warmup_steps=max(5, total_steps // 5))
    loss.backward(); opt.step(); opt.zero_grad()     # no DDP gradient all-reduce

Grouped (default, `opt.grouped = True`; `thinwire.optim.apmsqueeze_steps`): m and v are views
of one flat float32 buffer each, every rule runs over all parameters at once, and a step reads
the host once with nonfinite='raise' and never with 'skip'; bit for bit the per-tensor path
(`grouped = False`, also what float64 parameters and several devices take).

Two tiers (FSDP2 shards, `process_group` = the group across sites): everything runs on this
rank's shard (Adam moments, momentum, error buffers), and the 1-bit all-reduce compresses the
flat vector of this rank's shards, with its per-chunk scales, across the sites.
"""

from __future__ import annotations

import warnings

import torch

from ..comm.collectives import padded_numel
from ..comm.onebit_scales import ChunkScales, TensorScales
from ..ops import adam_denominator, adam_moments_
from .apmsqueeze_errors import ERRORS_KEY, remap_errors
from .apmsqueeze_groups import adam_update_, frozen_denominator, local_momentum
from .apmsqueeze_steps import GroupedSteps
from .base import CommunicatingOptimizer, Member, flatten_grads
from .elastic_rules import REPLICATED
from .exchange import ReduceAll
from .flat import spans, views
from .relay import OneBitReduce

ERROR_RESUME = ("exact", "reset")
SCALES = ("chunk", "tensor")        # the 1-bit compressions' granularity (`thinwire.comm.onebit_scales`)
# Fewest warmup steps: after T, the smallest sqrt(v̂) of N coordinates is ~N^(-1/T) of the typical one, so the 1-bit
# step (chunk scale / sqrt(v̂)) is up to ~N^(1/T) Adam's. Harness `tiny` preset (4 workers, seeds 0-2, flat and
# --sites 2): warmup 1 / 2 / 3 diverged in 6 / 4 / 1 of 6 runs, warmup 5 in none (val loss 3.23-3.34).
MIN_WARMUP_STEPS = 5


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


class APMSqueeze(GroupedSteps, CommunicatingOptimizer):
    """Adam for `warmup_steps`, then 1-bit compressed momentum with frozen v (module docstring).

    Args:
        lr: η. warmup_steps: dense Adam steps before v freezes, an integer >= MIN_WARMUP_STEPS
            (5; 15-25 % of training is DeepSpeed's advice). The compressed phase divides by
            sqrt(v̂), which only warmup steps estimate: with none, v would stay 0 and no parameter
            would move; with 1-4, v̂ averages so few squared gradients that some coordinates'
            sqrt(v̂) is far below their chunk's 1-bit scale and training diverges (ValueError).
        betas: (β1, β2) in [0, 1). eps: ε > 0. weight_decay: decoupled λ (AdamW style).
        bias_correction: Adam's 1 / (1 − β^t) factors (default True; False: the paper's equations).
        mask_unseen: coordinates whose frozen sqrt(v̂) is below ε get no momentum update in the
            compressed phase (default True): v = 0 (no rank ever had a gradient there during
            warmup, e.g. embedding rows of tokens not yet seen), and gradients that are zero in
            exact arithmetic but not in floats (GPT-2's attention key bias: without rotary
            embeddings it adds q·b to every key's score alike, which softmax ignores, so its
            gradient is rounding, ~1e-12, and v̂ ~1e-24). The 1-bit m̄ gives every coordinate
            a magnitude of its chunk's scale s, and m̄ / (sqrt(v̂) + ε) > s / 2ε would throw such
            coordinates ~lr·s/ε per step, where Adam's own steps there were below ~lr·sqrt(v̂)/ε
            < lr. DeepSpeed leaves this to a user-given exp_avg_mask; False gives the paper's
            update everywhere. Weight decay still applies there.
        scale: the granularity of both 1-bit compressions: 'tensor' (default, DeepSpeed's:
            each tensor's worker scale the RMS of the whole tensor, each server scale the RMS of a
            tensor's part of the server's chunk; a chunk message carries one scale per tensor
            part) or 'chunk' (one RMS scale per chunk of N / W elements of the flat vector,
            spanning tensors; the default before it was measured worse).
        error_resume: what load_state_dict does with error buffers saved by another world size
            or rank: 'exact' (default) raises ValueError; 'reset' zeroes them with a warning.
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite; in
            both cases no parameter moves that step, on any rank, and no state changes.
        overlap: False (default) blocks in step() until the exchange completes; True leaves it
            in flight until the next step() (one step of staleness; `thinwire.optim.base`).
        process_group: torch.distributed group (default: world; none needed for one process).
    A rank without a gradient for a parameter that another rank has one for counts it as
    zero; a parameter with a gradient on no rank does not move and keeps its state.
    warmup_steps is global (the envelope's step count, skipped steps included): the phase
    decides the collective, so every rank switches at the same step. State per parameter:
    step, exp_avg (m), exp_avg_sq (v) and exp_avg_sq_step (the t of v's bias correction),
    float32 whatever the parameter's dtype.
    """

    def __init__(self, params, lr: float, warmup_steps: int, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, process_group=None, bias_correction: bool = True,
                 mask_unseen: bool = True, error_resume: str = "exact", nonfinite: str = "raise",
                 overlap: bool = False, scale: str = "tensor"):
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= {MIN_WARMUP_STEPS}, got {warmup_steps!r}: the "
                             "compressed phase divides by sqrt(v), which only warmup steps estimate (with none, "
                             "v stays 0 and no parameter would ever move)")
        if warmup_steps < MIN_WARMUP_STEPS:
            raise ValueError(f"warmup_steps must be >= {MIN_WARMUP_STEPS}, got {warmup_steps}: the frozen v̂ would "
                             f"average only {warmup_steps} squared gradient(s), so some coordinates' sqrt(v̂) is far "
                             "below their chunk's scale and the 1-bit momentum divided by it diverges; DeepSpeed "
                             "advises 15-25 % of training for the warmup")
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        if error_resume not in ERROR_RESUME:
            raise ValueError(f"error_resume must be one of {ERROR_RESUME}, got {error_resume!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        _check_group(defaults)
        super().__init__(params, defaults)
        self.warmup_steps, self.bias_correction, self.error_resume = warmup_steps, bool(bias_correction), error_resume
        self.mask_unseen, self.scale = bool(mask_unseen), scale
        self._scales, self._scales_key = ChunkScales(), None    # the collective's scales for this layout
        self._init_comm(process_group, nonfinite, overlap)
        self.worker_error: torch.Tensor | None = None    # [N] float32, this rank's δ_i
        self.server_error: torch.Tensor | None = None    # [N / W] float32, this rank's chunk's δ̄
        self._dense: ReduceAll | None = None             # the warmup's exchange (dropped after it)
        self._onebit = OneBitReduce(self.comm)
        self._x: torch.Tensor | None = None              # [N] float32: m_i out, m̄ back
        self._spans: dict = {}                           # p -> (offset, numel) in the flat buffers, compressed steps
        self._denoms: dict = {}                          # p -> (settings, D): v is frozen
        self._init_grouped()

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @property
    def phase(self) -> str:
        """The phase of the next step."""
        return "warmup" if self._step < self.warmup_steps else "compressed"

    # ---- the algorithm, inside the envelope ------------------------------------------------------
    def _describe(self, layout: list[Member]) -> str:
        head = f"apmsqueeze world_size={self.comm.world_size} warmup_steps={self.warmup_steps} scale={self.scale} "
        return head + " ".join(f"{tuple(m.param.shape)}:{m.param.dtype}" for m in layout)

    def _exchange(self, step: int, layout: list[Member]):
        if not layout:
            return None
        numel, device = sum(m.param.numel() for m in layout), layout[0].param.device
        if step <= self.warmup_steps:
            self._spans = {}
            self._dense = self._dense or ReduceAll(self.comm)
            self._dense.resize(len(layout), numel, torch.float32, device)
            return self._dense
        self._dense = None                                   # its buffer is no longer needed
        world = self.comm.world_size
        n = padded_numel(numel, world)
        if self.worker_error is None or self.worker_error.numel() != n:
            # first compressed step (or a changed layout, whose old errors no longer line up)
            self.worker_error = torch.zeros(n, dtype=torch.float32, device=device)
            self.server_error = torch.zeros(n // world, dtype=torch.float32, device=device)
        if self._x is None or self._x.numel() != n or self._x.device != device:
            self._x = torch.empty(n, dtype=torch.float32, device=device)
        self._spans = dict(zip((m.key for m in layout), spans(m.param.numel() for m in layout)))
        self._onebit.deferred = self.nonfinite == "skip" and self._grouped_now(layout)
        key = (self.scale, tuple(m.param.numel() for m in layout), world, n, device)
        if self.scale == "tensor" and key != self._scales_key:           # made again when the layout changes
            self._scales, self._scales_key = TensorScales(list(key[1]), world, n, device), key
        self._onebit.resize(len(layout), self._x, self.worker_error, self.server_error, self._scales)
        return self._onebit

    def _prepare(self, step: int, layout: list[Member]) -> None:
        if self._grouped_now(layout):
            return self._flat.bind(self.state, layout)
        for _, p, key in layout:
            state = self.state[key]
            if "exp_avg" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq_step"] = 0

    def _encode(self, step: int, layout: list[Member], exchange) -> None:
        if exchange is None:
            return
        if self._grouped_now(layout):
            return self._encode_grouped(step, layout, exchange)
        if step <= self.warmup_steps:                        # the gradients, to be averaged
            flatten_grads([m.param for m in layout], exchange.payload)
            return
        x, params = exchange.payload, [m.param for m in layout]
        for (group, p, key), part in zip(layout, views(x, params)):
            local_momentum(part, self.state[key]["exp_avg"], p.grad, group["betas"][0])
        x[sum(p.numel() for p in params):].zero_()           # padding (m̄ was decoded into it)

    def _apply(self, step: int, layout: list[Member], delivery) -> None:
        """Warmup: delivery.data is the mean gradient; compressed: m̄. Both flat, float32."""
        if self._grouped_now(layout):
            return self._apply_grouped(step, layout, delivery)
        warmup, parts = step <= self.warmup_steps, views(delivery.data, [m.param for m in layout])
        for (group, p, key), part, anywhere in zip(layout, parts, delivery.present.tolist()):
            if not anywhere:
                continue
            state, (beta1, beta2) = self.state[key], group["betas"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            state["step"] += 1
            t = state["step"]
            if warmup:
                # m ← β1 m + (1 − β1) g,  v ← β2 v + (1 − β2) g²   (g: the averaged gradient)
                adam_moments_(m, v, part, beta1, beta2)
                state["exp_avg_sq_step"] += 1
                t_v = state["exp_avg_sq_step"]
                denom = adam_denominator(v, 1 - beta2 ** t_v if self.bias_correction else 1.0, group["eps"])
            else:
                # m ← m̄ (the same on every rank)
                m.copy_(part)
                denom = self._frozen_denominator(key, group)
            adam_update_(p, m, denom, group["lr"], group["weight_decay"],
                         1 - beta1 ** t if self.bias_correction else 1.0)

    def _frozen_denominator(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """`frozen_denominator` of parameter p (the param group's tensor), cached: v and its step count no longer change."""
        state = self.state[p]
        key = (state["exp_avg_sq_step"], group["betas"][1], group["eps"], self.bias_correction, self.mask_unseen)
        cached = self._denoms.get(p)
        if cached is None or cached[0] != key:
            cached = self._denoms[p] = (key, frozen_denominator(state["exp_avg_sq"], *key))
        return cached[1]

    def _local_views(self, p: torch.Tensor) -> list[torch.Tensor]:
        """p's share of the error buffers on a compressed step: its range [offset, offset + numel)
        of δ_i, and the part of this rank's server chunk δ̄ that overlaps that range."""
        span = self._spans.get(p)
        if span is None or self.worker_error is None:
            return []
        offset, numel = span
        views = [self.worker_error[offset: offset + numel]]
        chunk = self.server_error.numel()
        first = self.comm.rank * chunk                       # this rank serves [first, first + chunk)
        lo, hi = max(offset, first), min(offset + numel, first + chunk)
        if lo < hi:
            views.append(self.server_error[lo - first: hi - first])
        return views

    # ---- checkpoints --------------------------------------------------------------------------
    ELASTIC_KINDS = {"*": REPLICATED}          # Adam moments of the mean gradient, m̄: the same on every rank

    def _elastic_state(self, states: list[dict], row: torch.Tensor, rank: int) -> dict:
        return {**super()._elastic_state(states, row, rank), ERRORS_KEY: remap_errors(self, states, row, rank)}

    def _elastic_sums(self, step: int) -> bool:
        return step <= self.warmup_steps       # the warmup's all-reduced sum of the W gradients

    def state_dict(self):
        self._verdicts.judge()                               # step counts of skipped steps taken back
        self._settle_counts()
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
        self._spans, self._denoms, self._counted = {}, {}, {}
        if saved is None or saved["worker_error"] is None:
            return
        here = (self.comm.world_size, self.comm.rank)
        if (saved["world_size"], saved["rank"]) != here:
            message = (f"this APMSqueeze state holds the error-feedback buffers of rank {saved['rank']} of "
                       f"{saved['world_size']}, but this is rank {here[1]} of {here[0]}; load each rank's "
                       "own state_dict on the same world size, or map them with thinwire.optim.elastic.remap")
            if self.error_resume == "exact":
                raise ValueError(message + ", or pass error_resume='reset' to restart the errors from zero")
            warnings.warn(message + "; error_resume='reset': worker and server errors restart from zero")
            return
        layout = self.layout()
        device = layout[0].param.device if layout else saved["worker_error"].device
        self.worker_error = saved["worker_error"].to(device=device, dtype=torch.float32).clone()
        self.server_error = saved["server_error"].to(device=device, dtype=torch.float32).clone()
