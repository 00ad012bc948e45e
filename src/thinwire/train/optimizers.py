"""The optimizer registry of the harness: command-line name -> how to build it.

    OPTIMIZERS["demo"].build(model, cfg, lr) -> Built(optimizer, forward_model, stats, counts_itself)
    OPTIMIZERS["demo"].build(model, cfg, lr, group=site_group)   # on FSDP2 shards (--sites)

Each entry has a factory, default learning rates per preset (from the sweep documented in
docs/harness.md) and its settings dataclass (train/settings.py: its flags). A new optimizer is
one settings class and one `register(...)` call (docs/design.md, "Adding an optimizer"). Every factory returns
the thing the training loop steps and the CommStats its bytes are counted in:
  * thinwire optimizers (DeMo, ..., DenseAllReduce around AdamW / Adam / Muon) count their
    own bytes in `opt.comm_stats` and call `begin_step()` themselves;
  * the dense AdamW / Adam baselines ("adamw", "adam") are torch DDP, as users run them:
    DDP's bucketed all-reduce overlapped with backward, each bucket's bytes counted by a comm
    hook that does not wait (train/ddp.py); their compute-only step time is measured before
    training with communication off (`Built.calibrate`). DenseAllReduce around them stays
    registered as "adamw-allreduce" / "adam-allreduce", the library's drop-in baseline;
  * PowerSGD is PyTorch's DDP communication hook; its collectives are counted exactly by
    `powersgd.count_ddp_hook_collectives`, and the loop calls `stats.begin_step()` before
    each backward (the hook communicates during backward).
Dense baselines send fp32 gradients (DenseAllReduce's default, DDP's buckets); the table says so.

Overlap. `cfg.overlap` (`--overlap`) builds every thinwire optimizer with overlap=True (its
exchange left in flight while the next step computes); a spec registered
`with_overlap_variant=True` gets a "<name>-overlap" entry too (demo-overlap, ...), built with
overlap whatever the flag, so one table can hold both. "diloco-delayed" and
"sparseloco-delayed" leave each sync in flight for a whole interval (delay = H): it lands
just before the next one leaves (thinwire.optim.periodic). PowerSGD and the DDP baselines cannot take it
(their `OptimizerSpec.why_no_overlap` says why; run.check_run refuses them with that line): DDP
overlaps its all-reduce with backward by itself.

Under `--sites` with several ranks per site (train/sites.py) a thinwire optimizer
(`on_shards`) is built on the model's FSDP2 shards with `group` = the process group across
sites; a dense baseline with an `hsdp` factory becomes the plain torch optimizer under FSDP2
HSDP (Muon, without one, is DenseAllReduce on the shards); PowerSGD's DDP hook is refused
(`why_no_shards`) before any worker starts.

Checkpoints (train/checkpoint.py) read two facts off `Built`: `per_rank_state` (set by `_wrap`
for every thinwire optimizer) and `replicas_drift` (the class's `REPLICAS_DRIFT`: LoRDO, DiLoCo, SparseLoCo). PowerSGD is not
checkpointed (`why_no_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch

from ..comm import CommStats
from ..optim import APMSqueeze, DeMo, DenseAllReduce, DiLoCo, EF21Muon, LoRDO, SignDeMo, SparseLoCo
from ..optim.apmsqueeze import MIN_WARMUP_STEPS
from .model import hidden_matrices
from .settings import (APMSqueezeSettings, DeMoSettings, DiLoCoSettings, EF21MuonSettings, LoRDOSettings,
                       PowerSGDSettings, Settings, SignDeMoSettings, SparseLoCoSettings, library_clip)


@dataclass
class Built:
    optimizer: torch.optim.Optimizer
    model: torch.nn.Module                 # what the loop calls forward on (DDP for PowerSGD)
    stats: CommStats
    counts_itself: bool = True             # False: the loop calls stats.begin_step()
    calibrate: Callable | None = None      # batches -> compute-only s/step (DDP; train/ddp.py)
    # True: a thinwire optimizer, whose state_dict() is this rank's own (error feedback, local
    # momenta), checkpointed under a per-rank key. False: a torch optimizer, checkpointed through
    # DCP's get_optimizer_state_dict (its state sharded under FSDP2 HSDP).
    per_rank_state: bool = False
    # Replicas differ between exchanges (local steps between syncs: LoRDO, DiLoCo), so a
    # checkpoint holds every rank's own parameters besides the one replica in "model".
    replicas_drift: bool = False


@dataclass
class OptimizerSpec:
    name: str
    build: Callable[[torch.nn.Module, object, float], Built]
    default_lr: dict[str, float]           # preset name -> learning rate
    dense: bool = False                    # a dense baseline (time-to-target reference)
    description: str = ""
    counterpart: str = "adamw"             # the dense baseline it compresses (its bytes ratio)
    hsdp: Callable | None = None           # dense: (params, cfg, lr) -> the torch optimizer under HSDP
    on_shards: bool = False                # a thinwire optimizer that runs on FSDP2 shards (group=)
    overlap: bool = False                  # an "<name>-overlap" entry: always built with overlap=True
    # Each "why_no_*" is a sentence naming the optimizer that says it cannot do that and why, for
    # the harness's error message; "" (thinwire optimizers): it can.
    why_no_overlap: str = ""               # cannot take overlap=True (--overlap is refused)
    why_no_shards: str = ""                # cannot run on FSDP2 shards (several ranks per site)
    why_no_checkpoint: str = ""            # a checkpoint would not hold all its state (train refuses)
    # cfg -> a sentence saying why this optimizer cannot run that configuration ("": it can)
    why_not_config: Callable[[object], str] | None = None
    settings: type[Settings] | None = None  # its own settings (train/settings.py): flags --<PREFIX>-<field>
    with_overlap_variant: bool = False     # register() adds "<name>-overlap" (built with overlap=True) too

    @property
    def can_overlap(self) -> bool:
        """Takes overlap=True (--overlap): the thinwire optimizers."""
        return not self.why_no_overlap

    def lr_for(self, preset: str) -> float:
        return self.default_lr.get(preset, self.default_lr["small"])


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def _overlap_variant(base: OptimizerSpec) -> OptimizerSpec:
    """"<name>-overlap": `base` built with overlap=True whatever cfg.overlap says."""
    def build(model, cfg, lr, group=None):
        return base.build(model, replace(cfg, overlap=True), lr, group=group)
    return OptimizerSpec(f"{base.name}-overlap", build, dict(base.default_lr), dense=False,
                         description=f"{base.description}, overlap=True (exchange in flight during the next step)",
                         counterpart=base.counterpart, on_shards=base.on_shards, overlap=True,
                         why_not_config=base.why_not_config, settings=base.settings)


def register(spec: OptimizerSpec) -> None:
    OPTIMIZERS[spec.name] = spec
    if spec.with_overlap_variant:
        OPTIMIZERS[f"{spec.name}-overlap"] = _overlap_variant(spec)


def get_optimizer(name: str) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def learning_rate(cfg, name: str, lrs: dict[str, float] | None = None) -> float:
    """Optimizer `name`'s base learning rate in run `cfg`: `lrs[name]` (a sweep's), else --lr
    (`cfg.lr`), else its registered default for the preset (a falsy one falls through)."""
    return (lrs or {}).get(name) or cfg.lr or get_optimizer(name).lr_for(cfg.name)


def _wrap(opt: torch.optim.Optimizer, model: torch.nn.Module) -> Built:
    """A thinwire optimizer's Built: it counts its own bytes, its state is this rank's, and its
    class says whether replicas drift between exchanges (`REPLICAS_DRIFT`)."""
    return Built(opt, model, opt.comm_stats, per_rank_state=True, replicas_drift=type(opt).REPLICAS_DRIFT)


def _ov(cfg) -> bool:
    return bool(getattr(cfg, "overlap", False))


def torch_adamw(params, cfg, lr):
    """The dense baseline's torch AdamW (and the inner optimizer of the local-step methods)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _torch_adam(params, cfg, lr):
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.95))


def _ddp(torch_opt):
    def build(model, cfg, lr, group=None):
        from .ddp import compute_only_step_s, ddp_dense
        ddp, stats = ddp_dense(model, process_group=group)
        opt = torch_opt(ddp.parameters(), cfg, lr)
        return Built(opt, ddp, stats, counts_itself=False,
                     calibrate=lambda batches: compute_only_step_s(ddp, opt, batches))
    return build


def _adamw_allreduce(model, cfg, lr, group=None):
    return _wrap(DenseAllReduce(torch_adamw(model.parameters(), cfg, lr), process_group=group, overlap=_ov(cfg)),
                 model)


def _adam_allreduce(model, cfg, lr, group=None):
    return _wrap(DenseAllReduce(_torch_adam(model.parameters(), cfg, lr), process_group=group, overlap=_ov(cfg)),
                 model)


def _muon(model, cfg, lr, group=None):
    """torch.optim.Muon on hidden matrices, AdamW on embeddings/head/norms (Muon's usual split);
    'match_rms_adamw' scaling lets both share one learning rate."""
    matrices, rest = hidden_matrices(model)
    inner = [torch.optim.Muon(matrices, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
             torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)]
    return _wrap(DenseAllReduce(inner, process_group=group, overlap=_ov(cfg)), model)


def _demo(model, cfg, lr, group=None, lookahead: str = "none"):
    s = cfg.settings(DeMoSettings)
    return _wrap(DeMo(model.parameters(), lr=lr, topk=s.topk, chunk=s.chunk, alpha=s.alpha, beta=s.beta,
                      values=s.values, momentum_form=s.momentum_form, weight_decay=0.0, process_group=group,
                      overlap=_ov(cfg) or lookahead != "none", lookahead=lookahead, clip=library_clip(s)), model)


def _sign_demo(model, cfg, lr, group=None):
    s = cfg.settings(SignDeMoSettings)
    return _wrap(SignDeMo(model.parameters(), lr=lr, topk=s.topk, chunk=s.chunk, beta=s.beta, process_group=group,
                          overlap=_ov(cfg)), model)


def _apmsqueeze_warmup(cfg) -> int:
    return round(cfg.settings(APMSqueezeSettings).compressed_after * cfg.steps)


def _apmsqueeze_short_warmup(cfg) -> str:
    warmup = _apmsqueeze_warmup(cfg)
    if warmup >= MIN_WARMUP_STEPS:
        return ""
    fraction = cfg.settings(APMSqueezeSettings).compressed_after
    return (f"--apmsqueeze-compressed-after {fraction} of {cfg.steps} steps gives APMSqueeze {warmup} dense "
            f"warmup step(s); it needs at least {MIN_WARMUP_STEPS} (its 1-bit phase divides by the v those "
            f"steps estimate): raise --apmsqueeze-compressed-after to {MIN_WARMUP_STEPS / cfg.steps:.3g} or more")


def _apmsqueeze(model, cfg, lr, group=None):
    return _wrap(APMSqueeze(model.parameters(), lr=lr, warmup_steps=_apmsqueeze_warmup(cfg), betas=(0.9, 0.95),
                            process_group=group, overlap=_ov(cfg)), model)


# EF21-Muon's radius for sign / RMS LMOs relative to the matrices' spectral radius: with
# torch Muon's 'original' scale a hidden matrix moves ~lr/sqrt(d) per entry, an entry of a
# sign-LMO group lr; 0.4 puts the embeddings near the AdamW step the Muon baseline gives them.
EF21_VECTOR_LR = 0.4
# Momentum weight β (M ← (1 − β) M + β g): with a compressed uplink G tracks M only as fast as
# the compressor lets it. With the top-44 % int8 uplink the sweep (docs/harness.md) found 0.3
# best (0.1: far worse; 0.2: +2.8 % over three seeds, 0.3: +0.44 %); with top-10 % it had
# preferred 0.2 over 0.05-0.1 (Muon's 0.95-0.9) and 0.3-0.4.
EF21_BETA = 0.3


def _ef21_muon(model, cfg, lr, group=None):
    matrices, rest = hidden_matrices(model)
    embeddings = [p for p in rest if p.dim() == 2]
    gains = [p for p in rest if p.dim() < 2]
    groups = [{"params": matrices, "lmo": "spectral"},
              {"params": embeddings, "lmo": "sign", "lr": lr * EF21_VECTOR_LR},
              {"params": gains, "lmo": "rms", "lr": lr * EF21_VECTOR_LR}]
    opt = EF21Muon([g for g in groups if g["params"]], lr=lr, beta=EF21_BETA, weight_decay=0.1, uplink=cfg.settings(EF21MuonSettings).uplink,
                   downlink="identity", topology="replicated", process_group=group, overlap=_ov(cfg))
    return _wrap(opt, model)


# LoRDO's per-tensor gradient clip ρ: the sweep (docs/harness.md) found 0.25 clearly better
# than the class default 1.0 (and no clipping worst) on the small preset.
LORDO_CLIP = 0.25


def _lordo(model, cfg, lr, group=None):
    matrices, rest = hidden_matrices(model)
    rank = cfg.settings(LoRDOSettings).rank or min(256, max(1, cfg.n_embd // 4))
    groups = [{"params": matrices, "low_rank": True}, {"params": rest, "low_rank": False}]
    return _wrap(LoRDO(groups, lr=lr, rank=rank, sync_every=cfg.sync_every, clip=LORDO_CLIP, betas=(0.9, 0.95),
                       weight_decay=0.1, process_group=group, overlap=_ov(cfg)), model)


def _delay(cfg, delayed: bool) -> dict:
    """delayed: each sync in flight for cfg.sync_delay steps (0: a whole interval, H), with overlap."""
    return {"overlap": True, "delay": cfg.sync_delay or cfg.sync_every} if delayed else {"overlap": _ov(cfg)}


def _diloco(model, cfg, lr, group=None, delayed: bool = False):
    inner, s = lambda ps: torch_adamw(ps, cfg, lr), cfg.settings(DiLoCoSettings)  # noqa: E731
    return _wrap(DiLoCo(model.parameters(), inner=inner, sync_every=cfg.sync_every, process_group=group,
                        outer_lr=s.outer_lr, outer_momentum=s.outer_momentum,
                        **_delay(cfg, delayed)), model)


def _sparseloco(model, cfg, lr, group=None, delayed: bool = False):
    """SparseLoCo with the run's compression (by default the paper's: top-128 of 64 x 64 chunks,
    2-bit values; --sparseloco-topk/-chunk/-values/-indices), its β and α (by default the paper's 0.95 and 1;
    --sparseloco-error-decay, --sparseloco-outer-lr), its eager jump's c when delayed
    (--sparseloco-eager-scale), its median-norm clip if asked (--sparseloco-clip), and the run's H, so it compares
    with DiLoCo at the same sync interval. The tiny preset's matrices are [256|192|64|32, 64] and
    [64, 256]: 64 x 64 chunks (wpe's 32 x 64 keeps 64, a norm's 64 keeps 2), the same 3.1 %
    everywhere."""
    inner, s = lambda ps: torch_adamw(ps, cfg, lr), cfg.settings(SparseLoCoSettings)  # noqa: E731
    return _wrap(SparseLoCo(model.parameters(), inner=inner, sync_every=cfg.sync_every, process_group=group,
                            topk=s.topk, chunk=s.chunk, values=s.values, indices=s.indices,
                            error_decay=s.error_decay, outer_lr=s.outer_lr, eager_scale=s.eager_scale,
                            clip=library_clip(s), **_delay(cfg, delayed)), model)


def _powersgd(model, cfg, lr, group=None):
    from .powersgd import ddp_powersgd
    ddp, stats = ddp_powersgd(model, rank=cfg.settings(PowerSGDSettings).rank)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    return Built(opt, ddp, stats, counts_itself=False)


# Default learning rates: the `small` values come from the sweep in docs/harness.md
# (benchmarks/lr_sweep.py, 4 workers, 300 steps); `tiny` (60 steps) uses a higher rate for its
# short schedule and `base` the small preset's, both unswept. `wan` (one window per worker
# and step) was swept for AdamW and DeMo (docs/harness.md); Adam and PowerSGD's inner AdamW
# take AdamW's rate there, unswept; the others fall back to their `small` rate. `sites` (the
# wan model on 4 workers in 2 sites) takes wan's rates, unswept.
_DENSE_LR = {"tiny": 3e-3, "small": 1e-3, "base": 1e-3, "wan": 3e-4, "sites": 3e-4}


def _ddp_overlaps_itself(name: str) -> str:
    return (f"{name} cannot overlap (torch DDP overlaps its bucketed all-reduce with backward by itself; "
            f"{name}-allreduce, thinwire's DenseAllReduce, takes --overlap)")


register(OptimizerSpec("adamw", _ddp(torch_adamw), dict(_DENSE_LR), dense=True,
                       description="torch DDP (fp32 bucketed all-reduce overlapped with backward) + AdamW",
                       hsdp=torch_adamw, why_no_overlap=_ddp_overlaps_itself("adamw")))
register(OptimizerSpec("adam", _ddp(_torch_adam), dict(_DENSE_LR), dense=True,
                       description="torch DDP (fp32 bucketed all-reduce overlapped with backward) + Adam",
                       counterpart="adam", hsdp=_torch_adam, why_no_overlap=_ddp_overlaps_itself("adam")))
register(OptimizerSpec("adamw-allreduce", _adamw_allreduce, dict(_DENSE_LR), dense=True,
                       description="thinwire DenseAllReduce (one fp32 all-reduce after backward) + AdamW"))
register(OptimizerSpec("adam-allreduce", _adam_allreduce, dict(_DENSE_LR), dense=True, counterpart="adam",
                       description="thinwire DenseAllReduce (one fp32 all-reduce after backward) + Adam"))
register(OptimizerSpec("muon", _muon, {"tiny": 3e-3, "small": 1e-2, "base": 1e-2}, dense=True,
                       description="dense fp32 all-reduce + Muon (AdamW for non-matrices)", counterpart="muon",
                       on_shards=True))
register(OptimizerSpec(
    "powersgd", _powersgd, {"tiny": 3e-3, "small": 1e-3, "base": 1e-3, "wan": 3e-4, "sites": 3e-4},
    description="PyTorch DDP PowerSGD hook (rank 4) + AdamW",
    settings=PowerSGDSettings,
    why_no_overlap="powersgd cannot overlap (PyTorch's PowerSGD hook runs inside backward and the harness waits on it)",
    why_no_shards="powersgd is PyTorch's DDP communication hook, which all-reduces whole gradients of an unsharded "
                  "model; it cannot run on FSDP2 shards",
    why_no_checkpoint="powersgd cannot be checkpointed: PyTorch's DDP hook keeps its error feedback outside the "
                      "optimizer, where no checkpoint reaches it"))
register(OptimizerSpec("demo", _demo, {"tiny": 3e-3, "small": 1e-3, "base": 1e-3, "wan": 4e-4, "sites": 4e-4},
                       description="DeMo (DCT top-k, signum)", on_shards=True, settings=DeMoSettings,
                       with_overlap_variant=True))
# SignDeMo: DeMo's rates, unswept (its update is DeMo's signum step)
register(OptimizerSpec("sign-demo", _sign_demo, {"tiny": 3e-3, "small": 1e-3, "base": 1e-3, "wan": 4e-4, "sites": 4e-4},
                       description="SignDeMo (DCT top-4 of 64x64, 1 sign bit each, no scale: Psyche's DeMo)",
                       on_shards=True, settings=SignDeMoSettings, with_overlap_variant=True))
register(OptimizerSpec("apmsqueeze", _apmsqueeze, {"tiny": 3e-3, "small": 1e-3, "base": 1e-3},
                       description="APMSqueeze (Adam warmup, then 1-bit momentum)", counterpart="adam", on_shards=True,
                       why_not_config=_apmsqueeze_short_warmup, settings=APMSqueezeSettings,
                       with_overlap_variant=True))
register(OptimizerSpec("ef21-muon", _ef21_muon, {"tiny": 1e-2, "small": 1.2e-1, "base": 1.2e-1},
                       description="EF21-Muon (replicated, beta 0.3, uplink top-44% int8)", counterpart="muon",
                       on_shards=True, settings=EF21MuonSettings, with_overlap_variant=True))
register(OptimizerSpec("lordo", _lordo, {"tiny": 3e-3, "small": 5e-3, "base": 5e-3},
                       description="LoRDO (low-rank Adam, sync every 32)", on_shards=True, settings=LoRDOSettings,
                       with_overlap_variant=True))
register(OptimizerSpec("diloco", _diloco, {"tiny": 3e-3, "small": 1e-3, "base": 1e-3},
                       description="DiLoCo (AdamW inner, Nesterov outer, sync every 32)", on_shards=True,
                       settings=DiLoCoSettings, with_overlap_variant=True))
# DiLoCo's inner rates, unswept; wan swept at --sync-every 8 (val loss at 600 steps): 6e-4 2.4098,
# 1e-3 2.4427, 1.5e-3 2.5247 (docs/results/2026-11-24-sparseloco-wan.md)
register(OptimizerSpec("sparseloco", _sparseloco, {"tiny": 3e-3, "small": 1e-3, "base": 1e-3, "wan": 6e-4},
                       description="SparseLoCo (AdamW inner, top-128/4096 2-bit error feedback, sync every 32)",
                       on_shards=True, settings=SparseLoCoSettings, with_overlap_variant=True))


for _name, _factory in (("diloco", _diloco), ("sparseloco", _sparseloco)):
    register(OptimizerSpec(f"{_name}-delayed", partial(_factory, delayed=True), dict(OPTIMIZERS[_name].default_lr),
                           description=f"{OPTIMIZERS[_name].description}, overlap=True, delay=H (each sync in flight "
                                       "for a whole interval; replicas keep their local steps)",
                           on_shards=True, overlap=True, settings=OPTIMIZERS[_name].settings))
# wan, lookahead swept (val loss at 600 steps): 3e-4 2.3995, 4e-4 (DeMo's) 2.4193, 5e-4 2.4884: a
# gradient taken at an estimate of the parameters tolerates a little less step than an exact one
register(OptimizerSpec("demo-lookahead", partial(_demo, lookahead="momentum"),
                       {**OPTIMIZERS["demo"].default_lr, "wan": 3e-4},
                       description=f"{OPTIMIZERS['demo'].description}, overlap=True, lookahead='momentum' (each "
                                   "gradient taken where this rank's momentum moves the parameters: Psyche's correction)",
                       counterpart=OPTIMIZERS["demo"].counterpart, on_shards=True, overlap=True,
                       settings=DeMoSettings))
