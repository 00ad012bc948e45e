"""The optimizer configurations whose step cost benchmarks/step_audit.py counts and
benchmarks/gpu_step.py times, on GPT-2-shaped parameters.

    CONFIGS[name] = StepConfig(build, period)
      build(params, process_group) -> optimizer
      period: steps in one cycle (1: every step exchanges; H: a periodic method's H steps,
              of which the one that starts a sync costs most)

torch's AdamW (foreach and fused) is the yardstick; "ddp-adamw" is not here (DDP's all-reduce
runs in backward, not in step()).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

import thinwire

SPARSELOCO_H, DILOCO_H, LORDO_H = 5, 32, 32


class StepConfig(NamedTuple):
    build: Callable
    period: int = 1
    thinwire: bool = True


def _adamw(ps, **kw):
    return torch.optim.AdamW(ps, lr=1e-4, **kw)


def _quarter_width(params) -> int:
    """LoRDO's rank as the harness picks it: width / 4 (the narrowest matrix side / 4)."""
    return max(1, min(min(p.shape) for p in params if p.dim() == 2) // 4)


CONFIGS: dict[str, StepConfig] = {
    "torch-adamw-foreach": StepConfig(lambda ps, pg: _adamw(ps, foreach=True), thinwire=False),
    "torch-adamw-fused": StepConfig(lambda ps, pg: _adamw(ps, fused=True), thinwire=False),
    "dense-adamw": StepConfig(lambda ps, pg: thinwire.DenseAllReduce(_adamw(ps, foreach=True), process_group=pg)),
    "demo": StepConfig(lambda ps, pg: thinwire.DeMo(ps, lr=1e-4, topk=32, chunk=64, process_group=pg)),
    "demo-lookahead": StepConfig(lambda ps, pg: thinwire.DeMo(ps, lr=1e-4, topk=32, chunk=64, overlap=True,
                                                              lookahead="momentum", process_group=pg)),
    "sparseloco-delayed": StepConfig(lambda ps, pg: thinwire.SparseLoCo(
        ps, inner=lambda q: _adamw(q, foreach=True), sync_every=SPARSELOCO_H, overlap=True, delay=SPARSELOCO_H - 1,
        process_group=pg), SPARSELOCO_H),
    "diloco": StepConfig(lambda ps, pg: thinwire.DiLoCo(ps, inner=lambda q: _adamw(q, foreach=True),
                                                        sync_every=DILOCO_H, process_group=pg), DILOCO_H),
    # nonfinite='skip' with fused torch optimizers: no host read in a steady-state step (issue 46)
    "dense-fused-skip": StepConfig(lambda ps, pg: thinwire.DenseAllReduce(_adamw(ps, fused=True), nonfinite="skip",
                                                                          process_group=pg)),
    "demo-skip": StepConfig(lambda ps, pg: thinwire.DeMo(ps, lr=1e-4, topk=32, chunk=64, nonfinite="skip",
                                                         process_group=pg)),
    "sparseloco-fused": StepConfig(lambda ps, pg: thinwire.SparseLoCo(
        ps, inner=lambda q: _adamw(q, fused=True), sync_every=SPARSELOCO_H, overlap=True, delay=SPARSELOCO_H - 1,
        process_group=pg), SPARSELOCO_H),
    "diloco-fused-skip": StepConfig(lambda ps, pg: thinwire.DiLoCo(ps, inner=lambda q: _adamw(q, fused=True),
                                                                   sync_every=DILOCO_H, nonfinite="skip",
                                                                   process_group=pg), DILOCO_H),
    "apmsqueeze": StepConfig(lambda ps, pg: thinwire.APMSqueeze(ps, lr=1e-4, warmup_steps=5, process_group=pg)),
    "ef21-muon": StepConfig(lambda ps, pg: thinwire.EF21Muon(ps, lr=0.02, process_group=pg)),
    "lordo": StepConfig(lambda ps, pg: thinwire.LoRDO(ps, lr=1e-4, rank=_quarter_width(ps), sync_every=LORDO_H,
                                                      process_group=pg), LORDO_H),
    # the house's smallest optimizer: per-tensor ChunkedTopK, Psyche's 1-bit messages
    "sign-demo": StepConfig(lambda ps, pg: thinwire.SignDeMo(ps, lr=1e-4, topk=4, chunk=64, process_group=pg)),
    # issue 47's three with nonfinite='skip' (the audit asks 0 host reads of them)
    "apmsqueeze-skip": StepConfig(lambda ps, pg: thinwire.APMSqueeze(ps, lr=1e-4, warmup_steps=5, nonfinite="skip",
                                                                     process_group=pg)),
    "ef21-muon-skip": StepConfig(lambda ps, pg: thinwire.EF21Muon(ps, lr=0.02, nonfinite="skip", process_group=pg)),
    "lordo-skip": StepConfig(lambda ps, pg: thinwire.LoRDO(ps, lr=1e-4, rank=_quarter_width(ps), sync_every=LORDO_H,
                                                           nonfinite="skip", process_group=pg), LORDO_H),
}
ISSUE_46 = ("dense-adamw", "demo", "demo-lookahead", "sparseloco-delayed", "diloco")


def gpt2_shapes(blocks: int, width: int = 768, vocab: int = 50257, context: int = 1024) -> list[tuple[int, ...]]:
    """GPT-2's parameter shapes (tied head) with `blocks` blocks of `width`."""
    d = width
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(blocks):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),        # ln_1, attn c_attn, c_proj
                   (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]    # ln_2, mlp c_fc, c_proj
    return shapes + [(d,), (d,)]                                         # ln_f


def make_params(shapes, device="cpu", dtype=torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of `shapes` with gradients (both N(0, 1) scaled), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device, dtype))
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(device, dtype)
        params.append(p)
    return params


def new_gradients(params, step: int, rank: int) -> None:
    """Fresh gradients for `step` on `rank` (different across ranks, as in training), in place."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
