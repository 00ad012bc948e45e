"""Each optimizer's settings in the harness: one frozen dataclass per optimizer, a docstring
under every field (the `--help` line of its flag), and a `check()` that is the optimizer's own.

    DeMoSettings(topk=58, values="int8")          a preset's, or the defaults
    --demo-topk 58                                the flag: --<PREFIX>-<field>
    cfg.settings(DeMoSettings).topk               what a factory reads (train/optimizers.py)

No optimizer owns a generic name: DeMo's top-k is `demo_topk`, SparseLoCo's `sparseloco_topk`.
A flat key `<prefix>_<field>` (PREFIX with '-' as '_') names a field wherever one name is
needed: `get_preset(..., demo_topk=58)`, a checkpoint's recorded config, an error message.
`check()` builds the optimizer on one throwaway parameter, so the harness refuses exactly what
the library's constructor refuses, with the library's message and the flag that set it; the
few settings the library has no argument for (a fraction of the run's steps, a rank 0 meaning
"from the width") are checked in the dataclass itself.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass, fields, replace
from functools import cache
from typing import ClassVar


@dataclass(frozen=True)
class Settings:
    """The base of every optimizer's settings."""

    PREFIX: ClassVar[str] = ""
    KNOWN: ClassVar[dict[str, type[Settings]]] = {}       # every settings class by PREFIX, as defined

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.PREFIX in Settings.KNOWN:
            raise TypeError(f"two settings classes with PREFIX {cls.PREFIX!r}")
        Settings.KNOWN[cls.PREFIX] = cls

    def check(self) -> None:
        """ValueError naming the flag of the first invalid field (default: none)."""

    def _built(self, build) -> None:
        """Run `build(params)` on one throwaway parameter; its ValueError names the flag."""
        import torch
        try:
            build([torch.nn.Parameter(torch.zeros(4, 4))])
        except ValueError as err:
            raise ValueError(f"{self.PREFIX}: {err}{self._flag_of(str(err))}") from None

    def _flag_of(self, message: str) -> str:
        """' (--demo-topk)' when the message starts with one of this class's fields."""
        first = re.match(r"[A-Za-z_]*", message).group(0)
        names = [f.name for f in fields(self)]
        return f" (--{self.PREFIX}-{first.replace('_', '-')})" if first in names else ""


def flat_key(cls: type[Settings], name: str) -> str:
    """The one-word name of a field: '<prefix>_<field>' ('ef21-muon', 'uplink' -> 'ef21_muon_uplink')."""
    return f"{cls.PREFIX.replace('-', '_')}_{name}"


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under its annotation), read from the source."""
    tree = ast.parse(inspect.getsource(cls))
    body, docs = tree.body[0].body, {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


@dataclass(frozen=True)
class DeMoSettings(Settings):
    """DeMo (`thinwire.DeMo`) in the harness: demo, demo-overlap, demo-lookahead."""

    PREFIX: ClassVar[str] = "demo"
    topk: int = 32
    """DCT coefficients kept per chunk."""
    chunk: int = 64
    """Target chunk side (64: 64x64 DCT chunks)."""
    alpha: float = 1.0
    """Momentum subtraction: the fraction of what was sent taken out of the momentum."""
    beta: float = 0.99
    """Momentum decay (swept: 0.99 beats the paper's 0.999 here)."""
    momentum_form: str = "ema"
    """ema (the paper's M <- bM + (1-b)g) or reference (bloc97's M <- bM + lr*g)."""
    values: str = "bf16"
    """Wire precision of the kept coefficients: fp32, bf16, int8 or sign."""
    clip: str = "none"
    """none, or median-norm: each sender's message per tensor scaled to at most the senders' median norm."""

    def check(self) -> None:
        from ..optim import DeMo
        clip = library_clip(self)
        self._built(lambda ps: DeMo(ps, topk=self.topk, chunk=self.chunk, alpha=self.alpha, beta=self.beta,
                                    momentum_form=self.momentum_form, values=self.values, clip=clip))


@dataclass(frozen=True)
class SignDeMoSettings(Settings):
    """SignDeMo (`thinwire.SignDeMo`, DeMo's 1-bit variant as Psyche runs it) in the harness: sign-demo."""

    PREFIX: ClassVar[str] = "sign-demo"
    topk: int = 4
    """DCT coefficients kept per chunk; each travels as its index and one sign bit."""
    chunk: int = 64
    """Target chunk side (64: 64x64 DCT chunks)."""
    beta: float = 0.999
    """Momentum decay of M <- beta M + lr g (the reference's form)."""

    def check(self) -> None:
        from ..optim import SignDeMo
        self._built(lambda ps: SignDeMo(ps, topk=self.topk, chunk=self.chunk, beta=self.beta))


@dataclass(frozen=True)
class PowerSGDSettings(Settings):
    """PyTorch's DDP PowerSGD hook in the harness: powersgd."""

    PREFIX: ClassVar[str] = "powersgd"
    rank: int = 4
    """Approximation rank of each gradient matrix."""

    def check(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"powersgd: rank must be an integer >= 1, got {self.rank!r} (--powersgd-rank)")


@dataclass(frozen=True)
class APMSqueezeSettings(Settings):
    """APMSqueeze (`thinwire.APMSqueeze`) in the harness: apmsqueeze, apmsqueeze-overlap."""

    PREFIX: ClassVar[str] = "apmsqueeze"
    compressed_after: float = 0.2
    """Fraction of the run's steps of dense Adam warmup before the 1-bit momentum."""

    def check(self) -> None:
        if not 0.0 <= self.compressed_after <= 1.0:
            raise ValueError(f"apmsqueeze: compressed_after must be in [0, 1], got {self.compressed_after} "
                             "(--apmsqueeze-compressed-after)")


@dataclass(frozen=True)
class EF21MuonSettings(Settings):
    """EF21-Muon (`thinwire.EF21Muon`) in the harness: ef21-muon, ef21-muon-overlap."""

    PREFIX: ClassVar[str] = "ef21-muon"
    uplink: str = "topk:0.44+int8"
    """Uplink compressor spec, e.g. topk:0.15+int8 or dct-topk:32+int8 (replicated topology, no downlink)."""

    def check(self) -> None:
        from ..optim import EF21Muon
        self._built(lambda ps: EF21Muon(ps, uplink=self.uplink))


@dataclass(frozen=True)
class LoRDOSettings(Settings):
    """LoRDO (`thinwire.LoRDO`) in the harness: lordo, lordo-overlap (its H: --sync-every)."""

    PREFIX: ClassVar[str] = "lordo"
    rank: int = 0
    """Projection rank r (0: the model width / 4, at most 256)."""

    def check(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lordo: rank must be an integer >= 0 (0: from the width), got {self.rank!r} "
                             "(--lordo-rank)")


@dataclass(frozen=True)
class DiLoCoSettings(Settings):
    """DiLoCo (`thinwire.DiLoCo`, AdamW inner) in the harness: diloco, -overlap, -delayed (H: --sync-every)."""

    PREFIX: ClassVar[str] = "diloco"
    outer_lr: float = 0.7
    """Outer Nesterov learning rate, > 0 (the published 0.7)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum in [0, 1) (the published 0.9; 0 with outer_lr 1: the replicas' plain average)."""

    def check(self) -> None:
        from ..optim import DiLoCo
        self._built(lambda ps: DiLoCo(ps, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum))


@dataclass(frozen=True)
class SparseLoCoSettings(Settings):
    """SparseLoCo (`thinwire.SparseLoCo`, AdamW inner) in the harness: sparseloco, -overlap, -delayed."""

    PREFIX: ClassVar[str] = "sparseloco"
    topk: int = 128
    """Values kept per chunk x chunk chunk, the density on every chunk (128: 3.1 %, the paper's)."""
    chunk: int = 64
    """Target chunk side (32 packs each index in 10 bits, not 12)."""
    values: str = "2bit"
    """Wire format of the kept values: 2bit, 8bit, int8, bf16 or fp32."""
    indices: str = "packed"
    """Coding of the kept indices: packed (ceil(log2 E) bits each) or elias-fano (each chunk's sorted, lossless)."""
    error_decay: float = 0.95
    """Decay beta of the error feedback e <- beta e + delta, in [0, 1] (the paper's 0.95)."""
    outer_lr: float = 1.0
    """Outer learning rate alpha of theta0 <- theta0 - alpha mean(sent), > 0 (the paper's 1)."""
    eager_scale: float = 1.0
    """sparseloco-delayed: c of the eager jump theta <- theta0 - c alpha (own message), finite, >= 0."""
    clip: str = "none"
    """none, or median-norm: each sender's message per tensor scaled to at most the senders' median norm."""

    def check(self) -> None:
        from ..optim import SparseLoCo
        clip = library_clip(self)
        self._built(lambda ps: SparseLoCo(ps, topk=self.topk, chunk=self.chunk, values=self.values,
                                          indices=self.indices, error_decay=self.error_decay,
                                          outer_lr=self.outer_lr, eager_scale=self.eager_scale, clip=clip))


# A settings `clip` as the flag takes it -> the library's `clip=` (thinwire.optim.median_clip).
# Off is the word 'none', not None: the CLI's flags are int, float or str, and an override of
# None means "not given" (config.get_preset), so None could not switch a preset's clip off.
CLIPS = {"none": None, "median-norm": "median-norm"}


def library_clip(settings: DeMoSettings | SparseLoCoSettings) -> str | None:
    """`settings.clip` as DeMo's and SparseLoCo's `clip=` argument: 'none' -> None (no clip),
    'median-norm' as it is; ValueError naming the flag for anything else."""
    if not isinstance(settings.clip, str) or settings.clip not in CLIPS:
        raise ValueError(f"{settings.PREFIX}: clip must be one of {', '.join(CLIPS)}, got {settings.clip!r} "
                         f"(--{settings.PREFIX}-clip)")
    return CLIPS[settings.clip]


def flat_fields() -> dict[str, tuple[type[Settings], str]]:
    """Every settings field by its flat key: 'demo_topk' -> (DeMoSettings, 'topk')."""
    return {flat_key(cls, f.name): (cls, f.name) for cls in Settings.KNOWN.values() for f in fields(cls)}


def with_flat(given: tuple[Settings, ...], flat: dict) -> tuple[Settings, ...]:
    """`given` (one instance per class at most) with flat keys' values set: the classes' defaults
    where a class is not given yet; ValueError for an unknown key."""
    known, out = flat_fields(), {type(s): s for s in given}
    for key, value in flat.items():
        if key not in known:
            raise ValueError(f"unknown setting {key!r}; known: {', '.join(sorted(known))}")
        cls, name = known[key]
        out[cls] = replace(out.get(cls, cls()), **{name: value})
    return tuple(out.values())
