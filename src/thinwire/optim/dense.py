"""Dense data-parallel baseline: mean all-reduce of every gradient, then any torch optimizer.

    opt = DenseAllReduce(torch.optim.AdamW(model.parameters(), lr=3e-4), grad_dtype=torch.bfloat16)
    loss.backward(); opt.step(); opt.zero_grad()

All gradients travel in one flat buffer of `grad_dtype` (fp32 or bf16; state it in every
comparison) through one all-reduce per step, counted by the same communicator as every
thinwire optimizer. Several optimizers can share the all-reduce (e.g. torch.optim.Muon for
matrices and AdamW for the rest): pass a list. A rank without a gradient for a parameter
that another rank has one for counts it as zero; a parameter with a gradient on no rank
keeps `grad = None`, so the wrapped optimizer leaves it alone, as it would without us.

Two tiers (FSDP2 shards, `process_group` = the group across sites): the all-reduce carries
this rank's shard of every gradient across the sites, and the wrapped torch optimizers step
the DTensor parameters as under FSDP2 alone (torch.optim.Muon's Newton–Schulz works on the
whole matrix through DTensor operations). This is HSDP's traffic counted by our communicator.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import CommunicatingOptimizer, Member, flatten_grads
from .elastic_rules import REPLICATED, expect_keys, torch_state
from .exchange import ReduceAll
from .flat import reuse, same_place, views
from .shards import set_grad

GRAD_DTYPES = (torch.float32, torch.bfloat16)


class DenseAllReduce(CommunicatingOptimizer):
    """Wraps torch optimizers; their param groups and state are this object's own (shared),
    so LR schedulers and `state_dict()` work on it as on the wrapped optimizer.

    overlap=True: step() applies the previous step's mean gradient and leaves this step's
    all-reduce in flight (`thinwire.optim.base`); the wrapped optimizers then see the mean
    as `.grad` only during their step, and the caller's gradients are left in place.
    nonfinite: 'raise' (default) or 'skip' when any rank's gradients (or their sum) are not
    finite; every rank decides on the same reduced trailer, so they raise or skip together.
    With 'skip' around torch's fused optimizers (`AdamW(..., fused=True)`) the decision stays
    on the device (their `found_inf`): no host read; a skipped step shows in `skipped_steps`
    at the next step() or flush() (`thinwire.optim.verdict`).
    """

    def __init__(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                 grad_dtype: torch.dtype = torch.float32, nonfinite: str = "raise", process_group=None,
                 overlap: bool = False):
        inner = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if not inner or not all(isinstance(o, torch.optim.Optimizer) for o in inner):
            raise ValueError("optimizers must be a torch.optim.Optimizer or a non-empty list of them")
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype must be one of {GRAD_DTYPES}, got {grad_dtype}")
        self.optimizers, self.grad_dtype = inner, grad_dtype
        # Share the wrapped optimizers' group dicts (not copies), so an LR scheduler on this
        # object changes the learning rate the wrapped step uses.
        self._sharing = True                 # torch's __init__ adds the shared groups through add_param_group
        super().__init__([g for o in inner for g in o.param_groups], {})
        self._sharing = False
        self._init_comm(process_group, nonfinite, overlap)
        self._message = ReduceAll(self.comm)
        self._rounded: dict[torch.dtype, torch.Tensor] = {}     # the flat mean in a gradient dtype (`_copy_means`)

    def add_param_group(self, param_group: dict) -> None:
        """New parameters join the last wrapped optimizer (its defaults fill the group)."""
        if self._sharing:
            return super().add_param_group(param_group)
        self.optimizers[-1].add_param_group(param_group)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers], **self._envelope_state()}

    def load_state_dict(self, state_dict) -> None:
        inner = state_dict.get("optimizers")
        if inner is None or len(inner) != len(self.optimizers):
            raise ValueError(f"state_dict holds {0 if inner is None else len(inner)} optimizer states, "
                             f"this DenseAllReduce wraps {len(self.optimizers)}")
        for opt, state in zip(self.optimizers, inner):
            opt.load_state_dict(state)
        # load_state_dict gives the wrapped optimizers new group dicts: share those instead.
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self._load_envelope_state(state_dict)

    ELASTIC_KINDS = {"*": REPLICATED}        # every rank steps on the same mean gradient

    def _elastic_state(self, states: list[dict], row: torch.Tensor, rank: int) -> dict:
        """Each wrapped optimizer's torch state, every key replicated."""
        expect_keys(states, "optimizers")
        if any(len(s["optimizers"]) != len(self.optimizers) for s in states):
            raise ValueError(f"a state wraps {len(states[0]['optimizers'])} optimizers, this DenseAllReduce "
                             f"wraps {len(self.optimizers)}")
        return {"optimizers": [torch_state(inner, [s["optimizers"][k] for s in states], row, self.ELASTIC_KINDS,
                                           False, f"optimizers[{k}]") for k, inner in enumerate(self.optimizers)]}

    def _elastic_sums(self, step: int) -> bool:
        return True                            # the all-reduced sum of the W gradients

    def _describe(self, layout: list[Member]) -> str:
        return f"dense world_size={self.comm.world_size} {self.grad_dtype} " + " ".join(
            f"{tuple(m.param.shape)}" for m in layout)

    def _exchange(self, step: int, layout: list[Member]) -> ReduceAll:
        numel = sum(m.param.numel() for m in layout)
        self._message.resize(len(layout), numel, self.grad_dtype, layout[0].param.device)
        return self._message

    def _masks_nonfinite(self, layout: list[Member]) -> bool:
        """The encode keeps no state: a rank's non-finite gradients go into its message and
        the flag with them, read by every rank after the all-reduce."""
        return True

    def _applies_masked(self, layout: list[Member]) -> bool:
        """nonfinite='skip' reads nothing on the host when every wrapped optimizer is one of
        torch's fused ones, which skip a step on the device (`found_inf`, as under GradScaler)."""
        return all(o.defaults.get("fused") and getattr(o, "_step_supports_amp_scaling", False)
                   for o in self.optimizers)

    def _apply_masked(self, step: int, layout: list[Member], delivery, skip: torch.Tensor) -> None:
        found = skip.to(torch.float32)                 # 1.0: the fused kernels leave θ and their state alone
        for o in self.optimizers:
            o.found_inf = found
        try:
            self._apply(step, layout, delivery)
        finally:
            for o in self.optimizers:
                del o.found_inf

    def _encode(self, step: int, layout: list[Member], exchange: ReduceAll) -> None:
        flatten_grads([m.param for m in layout], exchange.payload, lambda dtype: self._narrow(exchange.payload, dtype))

    def _apply(self, step: int, layout: list[Member], delivery) -> None:
        """Every parameter with a gradient somewhere gets the mean; then the wrapped steps."""
        if self.overlap:
            return self._apply_beside(layout, delivery)
        grads, means = [], []
        for (_, p, key), part, anywhere in _mean_parts(layout, delivery):
            if not anywhere:
                continue
            if p.grad is None:                      # key's gradient: the wrapped optimizer reads that
                set_grad(key, part.to(p.dtype).clone(memory_format=torch.preserve_format))
            else:                                   # p.grad shares key.grad's storage (its shard)
                grads.append(p.grad)
                means.append(part)
        if grads:
            self._copy_means(grads, means, delivery.data)
        for o in self.optimizers:
            o.step()

    def _narrow(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A buffer shaped like `flat` in `dtype`, kept across steps: gradients of that dtype go
        in through it (`flatten_grads`) and their means come out through it (`_copy_means`)."""
        self._rounded[dtype] = reuse(self._rounded.get(dtype), flat.numel(), dtype, flat.device)
        return self._rounded[dtype].view(flat.shape)

    def _copy_means(self, grads: list[torch.Tensor], means: list[torch.Tensor], flat: torch.Tensor) -> None:
        """grads ← means (views of the flat mean `flat`), one fused copy per gradient dtype:
        torch's `_foreach_copy_` loops tensor by tensor over mixed dtypes, so the means of
        another dtype's gradients come from one rounding copy of the whole flat mean (the same
        round-to-nearest-even a per-tensor copy makes) into a buffer of that dtype kept for it."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for dtype, members in by_dtype.items():
            sources = [means[i] for i in members]
            if dtype != flat.dtype:
                rounded = self._narrow(flat, dtype).copy_(flat)
                sources = [same_place(m, flat, rounded) for m in sources]
            torch._foreach_copy_([grads[i] for i in members], sources)

    def _apply_beside(self, layout: list[Member], delivery) -> None:
        """Overlap: the caller's gradients already belong to the next step, so the wrapped
        optimizers step on the mean as `.grad` (None where no rank had one), and each
        parameter's own gradient is put back afterwards."""
        kept = []
        for (_, p, key), part, anywhere in _mean_parts(layout, delivery):
            kept.append((key, key.grad))
            key.grad = None
            if anywhere:
                set_grad(key, part.to(p.dtype))
        try:
            for o in self.optimizers:
                o.step()
        finally:
            for key, grad in kept:
                key.grad = grad


def _mean_parts(layout: list[Member], delivery):
    """(member, its part of the mean gradient shaped like its param, whether any rank had one)."""
    return zip(layout, views(delivery.data, [m.param for m in layout]), delivery.present.tolist())
