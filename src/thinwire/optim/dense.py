"""Dense data-parallel baseline: mean all-reduce of every gradient, then any torch optimizer.

    opt = DenseAllReduce(torch.optim.AdamW(model.parameters(), lr=3e-4), grad_dtype=torch.bfloat16)
    loss.backward(); opt.step(); opt.zero_grad()

All gradients travel in one flat buffer of `grad_dtype` (fp32 or bf16; state it in every
comparison) through one all-reduce per step, counted by the same communicator as every
thinwire optimizer. Several optimizers can share the all-reduce (e.g. torch.optim.Muon for
matrices and AdamW for the rest): pass a list. Gradients that are None count as zero.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import STATS_KEY, CommunicatingOptimizer, flatten_grads
from .protocol import NonFiniteGradientError, check_nonfinite_policy

GRAD_DTYPES = (torch.float32, torch.bfloat16)


class DenseAllReduce(CommunicatingOptimizer):
    """Wraps torch optimizers; their param groups and state are this object's own (shared),
    so LR schedulers and `state_dict()` work on it as on the wrapped optimizer.

    nonfinite: 'raise' (default) or 'skip' when the averaged gradient is not finite (which
    is the case whenever any rank's gradient is); all ranks decide on the same reduced
    buffer, so they raise or skip together.
    """

    def __init__(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                 grad_dtype: torch.dtype = torch.float32, nonfinite: str = "raise", process_group=None):
        inner = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if not inner or not all(isinstance(o, torch.optim.Optimizer) for o in inner):
            raise ValueError("optimizers must be a torch.optim.Optimizer or a non-empty list of them")
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype must be one of {GRAD_DTYPES}, got {grad_dtype}")
        self.optimizers, self.grad_dtype = inner, grad_dtype
        self.nonfinite = check_nonfinite_policy(nonfinite)
        # Share the wrapped optimizers' group dicts (not copies), so an LR scheduler on this
        # object changes the learning rate the wrapped step uses.
        super().__init__([g for o in inner for g in o.param_groups], {})
        self._init_comm(process_group)
        self._buffer: torch.Tensor | None = None

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers], STATS_KEY: self.comm.stats.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        inner = state_dict.get("optimizers")
        if inner is None or len(inner) != len(self.optimizers):
            raise ValueError(f"state_dict holds {0 if inner is None else len(inner)} optimizer states, "
                             f"this DenseAllReduce wraps {len(self.optimizers)}")
        for opt, state in zip(self.optimizers, inner):
            opt.load_state_dict(state)
        # load_state_dict gives the wrapped optimizers new group dicts: share those instead.
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        if STATS_KEY in state_dict:
            self.comm.stats.load_state_dict(state_dict[STATS_KEY])

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._begin_step(closure)
        params = self.params
        self._agree(f"world_size={self.comm.world_size} dense {self.grad_dtype} "
                    + " ".join(str(tuple(p.shape)) for p in params))
        flat = self._buffer = flatten_grads(params, self._buffer, self.grad_dtype)
        self.comm.all_reduce(flat)
        if not bool(torch.isfinite(flat).all()):
            if self.nonfinite == "raise":
                raise NonFiniteGradientError("non-finite averaged gradient: some rank's gradients are not "
                                             "finite; no parameter was updated on any rank")
            return loss
        flat.div_(self.comm.world_size)
        self._unflatten(flat, params)
        for o in self.optimizers:
            o.step()
        return loss

    def _unflatten(self, flat: torch.Tensor, params) -> None:
        offset = 0
        for p in params:
            chunk = flat[offset: offset + p.numel()].view(p.shape)
            if p.grad is None:
                p.grad = chunk.to(p.dtype).clone()
            else:
                p.grad.copy_(chunk)
            offset += p.numel()
