"""SignDeMo: DeMo with 1-bit messages, as Psyche runs it (DisTrO, the production descendant
of Peng et al., arXiv 2411.19870): the signs of a few DCT coefficients per chunk, no scale.

Per parameter, on every rank i, each step (bloc97/DeMo's arithmetic, which Psyche ports):

    M_i ← β M_i + η g_i                              local momentum, η inside (the reference's form)
    Q_i = Top-k per chunk of T(M_i)                  T: chunked orthonormal DCT; indices and values
    M_i ← M_i − T⁻¹(Q_i)                             the kept coefficients themselves leave M_i:
                                                     the 1-bit error is not fed back (Psyche's choice)
    message: Q_i's indices, bit-packed, and sign(Q_i) one bit each (zero as +), no scale
    Δ = T⁻¹( mean over the ranks that sent each coefficient of their signs )   (the reference's
                                                     mean over senders; 'mean': over all ranks)
    θ ← θ (1 − η λ) − η sign(Δ)

What a rank sends is k (index bits + 1) bits per chunk: at chunk 64 and top 4, 4 x 13 bits per
4,096 values, 1/2,520 of fp32 (DeMo at its defaults, top 32 in bf16: 32 x 28 bits). Unlike
DeMo, no scale travels, so every sender weighs the same: a sign vote per coefficient.

The house's smallest optimizer (docs/design.md, "Adding an optimizer"): the envelope's four
hooks on the per-tensor compressor `ChunkedTopK`, tensor by tensor. Not GPU-shaped: at world 2
on GPT-2 shapes a step launches 2,614 kernels at 2 blocks and 9,346 at 8, and reads the host
twice (`benchmarks/step_audit.py --optimizers sign-demo`; DeMo's grouped step: 101 and 1).
`thinwire.DeMo(values='sign')` is the grouped, scaled variant, with DeMo's error feedback of
what the wire delivers. A rank's non-finite gradients are found before the encode (the envelope reads
them: a sign bit cannot carry a NaN); a flagged step puts Q_i back into M_i, as DeMo does.
"""

from __future__ import annotations

import torch

from ..compress import ChunkedTopK, Payload
from ..compress.topk import AGGREGATIONS
from .base import CommunicatingOptimizer, Member
from .elastic_rules import PER_RANK
from .exchange import GatherAll
from .flat import spans

VALUES = "signbit"       # thinwire.wire.values: one bit per value, decoded as +1 / -1


class SignDeMo(CommunicatingOptimizer):
    """DeMo's 1-bit sign variant (Psyche's); the module docstring has the equations.

    Args:
        lr: η >= 0. beta: momentum decay β in [0, 1). topk: coefficients kept per chunk
            (default 4). chunk: target chunk side (default 64; dimensions chunked as DeMo's).
        weight_decay: decoupled λ >= 0. aggregate: 'senders' (default, the reference's mean
            over the ranks that sent a coefficient) or 'mean' (over all ranks).
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite.
        overlap: leave each step's exchange in flight until the next step() (one step stale).
        process_group: torch.distributed group (default: world; none needed for one process).
    State per parameter: 'momentum' (M_i, the parameter's shape, float32), this rank's own.
    """

    ELASTIC_KINDS = {"momentum": PER_RANK}         # error feedback: each rank's own unsent momentum
    STORE_EXCHANGE = True          # one GatherAll per step; a message that missed a round returns to M

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.999, topk: int = 4, chunk: int = 64,
                 weight_decay: float = 0.0, aggregate: str = "senders", nonfinite: str = "raise",
                 process_group=None, overlap: bool = False):
        defaults = dict(lr=lr, beta=beta, topk=topk, chunk=chunk, weight_decay=weight_decay, aggregate=aggregate)
        _check_group(defaults)
        super().__init__(params, defaults)
        self._init_comm(process_group, nonfinite, overlap)
        self._message = GatherAll(self.comm)
        self._compressors: dict[tuple[int, int], ChunkedTopK] = {}
        self._sent: list[tuple] = []          # this step's (momentum, Q_i) per parameter, until it lands
        self._arrived: list[list] = []        # every rank's read per parameter, from `_arrival` to `_apply`

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def compressor(self, group: dict) -> ChunkedTopK:
        key = (int(group["topk"]), int(group["chunk"]))
        if key not in self._compressors:
            self._compressors[key] = ChunkedTopK(*key, transform="dct", values=VALUES)
        return self._compressors[key]

    def _places(self, layout: list[Member]) -> list:
        return spans(self.compressor(m.group).payload_nbytes(m.param.shape) for m in layout)

    def _describe(self, layout: list[Member]) -> str:
        return f"sign-demo world_size={self.comm.world_size} " + " ".join(
            f"{tuple(m.param.shape)}:k{m.group['topk']}c{m.group['chunk']}:{m.group['aggregate']}" for m in layout)

    def _exchange(self, step: int, layout: list[Member]) -> GatherAll:
        places = self._places(layout)
        self._message.resize(len(layout), places[-1].start + places[-1].size if places else 0,
                             layout[0].param.device)
        return self._message

    def _prepare(self, step: int, layout: list[Member]) -> None:
        for m in layout:
            if "momentum" not in self.state[m.key]:
                self.state[m.key]["momentum"] = torch.zeros(m.param.shape, device=m.param.device)

    def _encode(self, step: int, layout: list[Member], exchange: GatherAll) -> None:
        """M ← βM + ηg; Q = top-k of T(M) into the message (indices and sign bits); M ← M − T⁻¹(Q)."""
        self._sent = []
        for m, place in zip(layout, self._places(layout)):
            group, p, comp = m.group, m.param, self.compressor(m.group)
            momentum = self.state[m.key]["momentum"]
            momentum.mul_(group["beta"])
            if p.grad is not None:
                momentum.add_(p.grad, alpha=group["lr"])
            plan = comp.plan(p.shape)
            image = comp.transform.forward_image(plan.transform_input(momentum), plan, step)    # T(M_i) [R, C]
            kept = comp.select(image, p.shape)                                  # (indices, exact values)
            comp.write(kept, p.shape, out=exchange.payload[place.start: place.start + place.size])
            momentum.sub_(comp.aggregate([kept], p.shape, step))                # T⁻¹(Q_i), exact
            self._sent.append((momentum, kept, comp, p.shape, step))

    def _discard(self, step: int, layout: list[Member], exchange: GatherAll) -> None:
        """A flagged step: what this rank sent returns to its momentum, to be sent later."""
        for momentum, kept, comp, shape, at in self._sent:
            momentum.add_(comp.aggregate([kept], shape, at))

    def _arrival(self, step: int, layout: list[Member], delivery) -> list[torch.Tensor]:
        """Every rank's payload read on the device; its flags (indices out of range) are read by
        the envelope with the prefixes, once."""
        gathered, flags = delivery.data, []                                     # [world, payload bytes]
        self._arrived = []
        for m, place in zip(layout, self._places(layout)):
            comp = self.compressor(m.group)
            spec, rows = comp.payload_spec(m.param.shape), gathered[:, place.start: place.start + place.size]
            got = [comp.read_flagged(Payload.from_buffer(rows[r], spec), m.param.shape) for r in range(len(rows))]
            self._arrived.append([read for read, _ in got])                     # rank order
            flags += [f for _, fs in got for f in fs]
        return flags

    def _keep_own(self, step: int, layout: list[Member], exchange: GatherAll) -> None:
        """This rank's message missed the store round: M ← M + T⁻¹(Q_i), as for a flagged step."""
        self._discard(step, layout, exchange)

    def _apply(self, step: int, layout: list[Member], delivery) -> None:
        """Δ = T⁻¹(mean of the ranks' signs); θ ← θ(1 − ηλ) − η sign(Δ), where some rank had a gradient."""
        for m, reads, here in zip(layout, self._arrived, delivery.present.tolist()):
            if here:
                group, p = m.group, m.param
                delta = self.compressor(group).aggregate(reads, p.shape, step, group["aggregate"])
                with torch.no_grad():
                    p.mul_(1.0 - group["lr"] * group["weight_decay"])
                    p.add_(delta.sign().to(p.dtype), alpha=-group["lr"])
        self._sent, self._arrived = [], []


def _check_group(g: dict) -> None:
    """ValueError naming the first invalid hyperparameter of a param group."""
    if not g["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {g['lr']}")
    if not 0.0 <= g["beta"] < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {g['beta']}")
    for name in ("topk", "chunk"):
        if isinstance(g[name], bool) or not isinstance(g[name], int) or g[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {g[name]!r}")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
    if g["aggregate"] not in AGGREGATIONS:
        raise ValueError(f"aggregate must be one of {AGGREGATIONS}, got {g['aggregate']!r}")
