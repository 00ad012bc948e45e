"""APMSqueeze's update rules, one equation per in-place operation: per tensor (`local_momentum`,
`frozen_denominator`, `adam_update_`, what `thinwire.optim.apmsqueeze` runs with grouped = False)
and on flat buffers (issue 47), every parameter at once with the same arithmetic:

    m, v      one float32 flat buffer each, in layout order (the order of the 1-bit message x);
              each `state[p]["exp_avg"]` / `["exp_avg_sq"]` is a view of it shaped like p, so
              checkpoints are unchanged; a state tensor replaced from outside (a load, a remap)
              is copied in and replaced by the view again (`FlatMoments.bind`)
    runs      consecutive parameters that share a hyperparameter (β1; β2 and the bias
              correction; ε) are one slice of the flat buffers: one op per run, one run when
              every parameter shares it (one param group, no missing gradients)
    θ         per parameter, with per-parameter factors: one `_foreach_*` call per dtype;
              float32 parameters in place, other dtypes (bf16, fp16) through a flat image of
              their own dtype widened to float32 (`Images`), rounded back as the per-tensor
              ops round: after the decay and after the step
    skip      nonfinite='skip' lands under a device flag (`thinwire.optim.verdict`): m and v
              keep their old values where it is set (`torch.where`), the step's numerator is 0
              and its decay factor 1, so no parameter moves; the host's step counts are taken
              back when the verdict, read a call later, says the step was skipped

A parameter with a gradient on no rank is updated like the others and put back exactly by the
envelope (`CommunicatingOptimizer._restore`: its snapshot of the parameter and these views).
"""

from __future__ import annotations

import math

import torch

from ..ops import adam_denominator, adam_moments_
from .flat import reuse, spans, views

LOW_DTYPES = (torch.bfloat16, torch.float16)        # parameters taken through a float32 image
DTYPES = (torch.float32, *LOW_DTYPES)


def runs(values: list, sizes: list[int]) -> list[tuple[object, slice]]:
    """(value, flat slice) for each run of consecutive parameters with equal `values`."""
    out: list[tuple[object, slice]] = []
    for value, span in zip(values, spans(sizes)):
        if out and out[-1][0] == value and out[-1][1].stop == span.start:
            out[-1] = (value, slice(out[-1][1].start, span.stop))
        else:
            out.append((value, slice(span.start, span.stop)))
    return out


def local_momentum(out: torch.Tensor, m_bar: torch.Tensor, g: torch.Tensor | None, beta1: float) -> None:
    """This rank's momentum, written into `out` (compressed phase); g None counts as 0."""
    # m_i = β1 m̄
    torch.mul(m_bar, beta1, out=out)
    if g is not None:
        # m_i += (1 − β1) g_i
        out.add_(g, alpha=1 - beta1)


def adam_update_(p: torch.Tensor, m: torch.Tensor, denom: torch.Tensor, lr: float, weight_decay: float,
                 bias_correction1: float) -> None:
    """The parameter step, as torch.optim.AdamW takes it."""
    if weight_decay:
        # θ ← θ (1 − η λ)
        p.mul_(1 - lr * weight_decay)
    # θ ← θ − η / (1 − β1^t) · m / D
    p.addcdiv_(m, denom, value=-lr / bias_correction1)


def frozen_denominator(v: torch.Tensor, t_v: int, beta2: float, eps: float, bias_correction: bool,
                       mask_unseen: bool) -> torch.Tensor:
    """The compressed phase's denominator from the frozen v (a new tensor)."""
    bias_correction2 = 1 - beta2 ** t_v if bias_correction and t_v > 0 else 1.0
    # D = sqrt(v / (1 − β2^T_w)) + ε
    denom = adam_denominator(v, bias_correction2, eps)
    if mask_unseen:
        # D ← +∞ where sqrt(v̂) < ε (v = 0 included: no gradient above Adam's floor ε in warmup): m̄ / D = 0
        denom.masked_fill_(v.sqrt() / math.sqrt(bias_correction2) < eps, math.inf)
    return denom


# ---- the update rules on flat slices (the per-tensor path's equations, run by run) ---------------

def warmup_moments_(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, betas: list[tuple[float, float]],
                    sizes: list[int]) -> None:
    """m ← β1 m + (1 − β1) g,  v ← β2 v + (1 − β2) g² on each run of equal betas."""
    for (beta1, beta2), part in runs(betas, sizes):
        adam_moments_(m[part], v[part], g[part], beta1, beta2)


def warmup_denominator_(out: torch.Tensor, v: torch.Tensor, corrections: list[tuple[float, float]],
                        sizes: list[int]) -> torch.Tensor:
    """out ← sqrt(v) / sqrt(1 − β2^t) + ε on each run of equal (bias correction, ε): `adam_denominator`."""
    for (correction, eps), part in runs(corrections, sizes):
        # D = √v / √bc2 + ε
        torch.sqrt(v[part], out=out[part]).div_(math.sqrt(correction)).add_(eps)
    return out


def momentum_message_(x: torch.Tensor, m: torch.Tensor, g: torch.Tensor, beta1s: list[float],
                      sizes: list[int]) -> None:
    """x ← β1 m̄ + (1 − β1) g on each run of equal β1 (`local_momentum`; a missing g is 0 in `g`)."""
    for beta1, part in runs(beta1s, sizes):
        # m_i = β1 m̄
        torch.mul(m[part], beta1, out=x[part])
        # m_i += (1 − β1) g_i
        x[part].add_(g[part], alpha=1 - beta1)


def keep_where_(skip: torch.Tensor | None, target: torch.Tensor, old: torch.Tensor) -> None:
    """target ← old where skip (a 0-dim bool), else as it is."""
    if skip is not None:
        torch.where(skip, old, target, out=target)


def decay_(targets: list[torch.Tensor], factors: list[float], skip: torch.Tensor | None) -> None:
    """θ ← θ (1 − η λ) for each target and its factor; 1 where skip (one 0-dim factor per value)."""
    if not targets:
        return
    if skip is None:
        torch._foreach_mul_(targets, factors)
        return
    for factor in dict.fromkeys(factors):
        chosen = [t for t, f in zip(targets, factors) if f == factor]
        # the factor, or 1 where the step is skipped (exact: θ · 1 = θ)
        torch._foreach_mul_(chosen, torch.where(skip, 1.0, factor))


class Images:
    """Flat images of the parameters of one low-precision dtype: that dtype and float32, kept."""

    def __init__(self):
        self.low: dict[torch.dtype, torch.Tensor] = {}
        self.wide: dict[torch.dtype, torch.Tensor] = {}

    def widen(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """float32 views of the parameters' values (one same-dtype cat, one exact widening copy)."""
        dtype, device, n = params[0].dtype, params[0].device, sum(p.numel() for p in params)
        low = self.low[dtype] = reuse(self.low.get(dtype), n, dtype, device)
        wide = self.wide[dtype] = reuse(self.wide.get(dtype), n, torch.float32, device)
        torch.cat([p.reshape(-1) for p in params], out=low)                  # [Σ numel]
        wide.copy_(low)
        return list(views(wide, params))

    def round_(self, dtype: torch.dtype) -> None:
        """The image rounded to `dtype` and widened again, as an in-place op on θ rounds it."""
        self.low[dtype].copy_(self.wide[dtype])
        self.wide[dtype].copy_(self.low[dtype])

    def write_back(self, params: list[torch.Tensor]) -> None:
        dtype = params[0].dtype
        self.low[dtype].copy_(self.wide[dtype])
        torch._foreach_copy_(params, list(views(self.low[dtype], params)))


def params_step_(params: list[torch.Tensor], numerators: list[torch.Tensor], denominators: list[torch.Tensor],
                 decays: list[float | None], steps: list[float], images: Images,
                 skip: torch.Tensor | None = None) -> None:
    """Per parameter (`adam_update_`): θ ← θ (1 − η λ) where λ ≠ 0 (decays[i] None: λ = 0), then
    θ ← θ − η / (1 − β1^t) · m / D (steps[i] = −η / (1 − β1^t)); one `_foreach_*` call per dtype."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        own = [params[i] for i in members]
        targets = own if dtype == torch.float32 else images.widen(own)
        decayed = [(t, decays[i]) for t, i in zip(targets, members) if decays[i] is not None]
        decay_([t for t, _ in decayed], [f for _, f in decayed], skip)
        if decayed and dtype != torch.float32:
            images.round_(dtype)
        # θ ← θ + (−η / (1 − β1^t)) · m / D
        torch._foreach_addcdiv_(targets, [numerators[i] for i in members], [denominators[i] for i in members],
                                [steps[i] for i in members])
        if dtype != torch.float32:
            images.write_back(own)


class FlatMoments:
    """m and v as flat float32 buffers whose views are the optimizer's state, and the flat
    scratch of a step (gradients, the denominator, the old moments of a masked step)."""

    def __init__(self):
        self.keys: list = []
        self.m = self.v = None
        self._bound: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scratch: dict[str, torch.Tensor] = {}
        self.frozen_key = None                      # what the cached frozen denominator was made from
        self.images = Images()

    def bind(self, state: dict, layout: list) -> None:
        """Make every layout parameter's exp_avg / exp_avg_sq a view of m / v (new parameters start
        at zero with step counts 0; tensors put in the state from outside are copied in)."""
        keys = [member.key for member in layout]
        if keys == self.keys and all(state[k].get("exp_avg") is mv and state[k].get("exp_avg_sq") is vv
                                     for k, (mv, vv) in zip(keys, self._bound)):
            return
        params = [member.param for member in layout]
        n, device = sum(p.numel() for p in params), params[0].device
        self.m = torch.zeros(n, dtype=torch.float32, device=device)
        self.v = torch.zeros(n, dtype=torch.float32, device=device)
        self._bound = list(zip(views(self.m, params), views(self.v, params)))
        for key, (mv, vv) in zip(keys, self._bound):
            st = state[key]
            if "exp_avg" in st:
                mv.copy_(st["exp_avg"])
                vv.copy_(st["exp_avg_sq"])
            else:
                st["step"], st["exp_avg_sq_step"] = 0, 0
            st["exp_avg"], st["exp_avg_sq"] = mv, vv
        self.keys, self.frozen_key = keys, None

    def buffer(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A kept flat scratch buffer as long as m."""
        self.scratch[name] = reuse(self.scratch.get(name), self.m.numel(), dtype, self.m.device)
        return self.scratch[name]

    def views(self, flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(views(flat, params))
