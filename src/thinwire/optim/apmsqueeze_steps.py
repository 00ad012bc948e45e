"""APMSqueeze's grouped step (`thinwire.optim.apmsqueeze_groups` holds the flat state and the
update rules): what `APMSqueeze` runs when `grouped` is True and the layout allows it (one
device; float32, bf16 and fp16 parameters). The bytes on the wire and every parameter and
state value are the per-tensor path's (`opt.grouped = False`), bit for bit on CPU (tested).

Per step, whatever the number of tensors: the gradients into one flat buffer (one cat per
dtype), the message or the moments one op per run of shared hyperparameters, the parameter
update one `_foreach_*` call per parameter dtype. The host reads nothing: this rank's
gradients' finiteness travels as a device flag (`_masks_nonfinite`: the encode keeps no
state, so a bad rank's message only carries its flag), and with nonfinite='skip' the step
lands under the device's verdict (`_apply_masked`); step counts of a skipped step are taken
back when its verdict is read, at the next call (`_settle_counts`).
"""

from __future__ import annotations

import torch

from .apmsqueeze_groups import (DTYPES, FlatMoments, frozen_denominator, keep_where_, momentum_message_,
                                params_step_, runs, warmup_denominator_, warmup_moments_)
from .base import Member, flatten_grads


class GroupedSteps:
    """The grouped path's hooks; mixed into `APMSqueeze` (which supplies the rest)."""

    grouped = True
    """False forces the per-tensor path (what float64, several devices and mixed layouts take)."""

    def _init_grouped(self) -> None:
        self._flat = FlatMoments()
        self._counted: dict[int, tuple[list, bool]] = {}   # a masked step -> (keys it counted, warmup)

    def _grouped_now(self, layout: list[Member]) -> bool:
        if not (self.grouped and layout):
            return False
        device = layout[0].param.device
        return all(m.param.device == device and m.param.dtype in DTYPES for m in layout)

    def _masks_nonfinite(self, layout: list[Member]) -> bool:
        """The encode keeps no state (the warmup's gradients and the compressed phase's m_i only
        go into the message), so a rank's non-finite gradients travel with their flag, unread."""
        return True

    def _applies_masked(self, layout: list[Member]) -> bool:
        return self._grouped_now(layout)

    def _apply_masked(self, step: int, layout: list[Member], delivery, skip: torch.Tensor) -> None:
        self._apply_grouped(step, layout, delivery, skip)

    def _narrow(self, dtype: torch.dtype) -> torch.Tensor:
        return self._flat.buffer(f"grads_{dtype}", dtype)

    def _encode_grouped(self, step: int, layout: list[Member], exchange) -> None:
        params = [m.param for m in layout]
        if step <= self.warmup_steps:                        # the gradients, to be averaged
            flatten_grads(params, exchange.payload, lambda dtype: self._narrow(dtype)[:exchange.payload.numel()])
            return
        flat, x, n = self._flat, exchange.payload, self._flat.m.numel()
        grads = flatten_grads(params, flat.buffer("scratch"), self._narrow)
        momentum_message_(x, flat.m, grads, [m.group["betas"][0] for m in layout], _sizes(layout))
        x[n:].zero_()                                        # padding (m̄ was decoded into it)

    def _apply_grouped(self, step: int, layout: list[Member], delivery, skip: torch.Tensor | None = None) -> None:
        """Warmup: delivery.data the mean gradient; compressed: m̄ (both flat float32). Where
        `skip` (nonfinite='skip', a 0-dim bool) is set, nothing moves (module docstring)."""
        self._settle_counts()
        self._flat.bind(self.state, layout)                  # a resumed step in flight lands before any _prepare
        warmup, flat = step <= self.warmup_steps, self._flat
        counted = [m.key for m, here in zip(layout, delivery.present.tolist()) if here]
        for key in counted:
            self.state[key]["step"] += 1
            self.state[key]["exp_avg_sq_step"] += int(warmup)
        if skip is not None:
            self._counted[step] = (counted, warmup)
        params, sizes, n = [m.param for m in layout], _sizes(layout), flat.m.numel()
        data = delivery.data[:n]
        if warmup:
            if skip is not None:
                old_m, old_v = flat.buffer("old_m").copy_(flat.m), flat.buffer("old_v").copy_(flat.v)
            warmup_moments_(flat.m, flat.v, data, [m.group["betas"] for m in layout], sizes)
            if skip is not None:
                keep_where_(skip, flat.m, old_m)
                keep_where_(skip, flat.v, old_v)
            denom = warmup_denominator_(flat.buffer("scratch"), flat.v, self._warmup_corrections(layout), sizes)
        else:
            flat.m.copy_(data) if skip is None else torch.where(skip, flat.m, data, out=flat.m)   # m ← m̄
            denom = self._frozen_flat(layout)
        # the step's numerator: m, or 0 where skipped (θ − (η/bc1) · 0 / D = θ exactly)
        numerator = flat.m if skip is None else flat.m.masked_fill(skip, 0.0)
        decays = [1 - m.group["lr"] * m.group["weight_decay"] if m.group["weight_decay"] else None for m in layout]
        params_step_(params, flat.views(numerator, params), flat.views(denom, params), decays,
                     [-m.group["lr"] / self._correction1(m) for m in layout], flat.images, skip)

    def _correction1(self, m: Member) -> float:
        """1 − β1^t (t ≥ 1: a parameter no rank had a gradient for is put back anyway)."""
        t = max(1, self.state[m.key]["step"])
        return 1 - m.group["betas"][0] ** t if self.bias_correction else 1.0

    def _warmup_corrections(self, layout: list[Member]) -> list[tuple[float, float]]:
        out = []
        for m in layout:
            t_v = max(1, self.state[m.key]["exp_avg_sq_step"])
            out.append((1 - m.group["betas"][1] ** t_v if self.bias_correction else 1.0, m.group["eps"]))
        return out

    def _frozen_flat(self, layout: list[Member]) -> torch.Tensor:
        """`frozen_denominator` of every parameter in one flat buffer, made again only when what it
        depends on changes (v is frozen)."""
        flat = self._flat
        settings = [(self.state[m.key]["exp_avg_sq_step"], m.group["betas"][1], m.group["eps"], self.bias_correction,
                     self.mask_unseen) for m in layout]
        if flat.frozen_key != settings:
            denom = flat.buffer("frozen")
            for key, part in runs(settings, _sizes(layout)):
                denom[part].copy_(frozen_denominator(flat.v[part], *key))
            flat.frozen_key = settings
        return flat.scratch["frozen"]

    def _settle_counts(self) -> None:
        """Take back the step counts of masked steps whose verdict (now read) skipped them."""
        if not self._counted:
            return
        pending, skipped = self._verdicts.pending_steps(), set(self._verdicts.skipped)
        for step in [s for s in self._counted if s not in pending]:
            keys, warmup = self._counted.pop(step)
            if step in skipped:
                for key in keys:
                    self.state[key]["step"] -= 1
                    self.state[key]["exp_avg_sq_step"] -= int(warmup)

    @property
    def skipped_steps(self) -> list[int]:
        skipped = super().skipped_steps                      # judged now
        self._settle_counts()
        return skipped

    def flush(self) -> None:
        """Judge the deferred verdicts first, so the step landed now counts only applied steps."""
        self._verdicts.judge()
        super().flush()
        self._settle_counts()


def _sizes(layout: list[Member]) -> list[int]:
    return [m.param.numel() for m in layout]
