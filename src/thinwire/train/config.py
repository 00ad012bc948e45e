"""Presets for `thinwire train` / `thinwire compare`, the options of a run (`RunOptions`:
workers, output, link, checkpoints), and parsing of bandwidths and links.

A preset is a named `TrainConfig`; command-line flags override single fields
(`dataclasses.replace`). Sizes are chosen for CPU workers: `tiny` is a smoke test (about
a minute on 2 cores), `small` the default comparison, `base` a longer, wider run, and
`wan` the link-bound regime: 2 workers, one window each per step, a model whose dense
fp32 gradient takes ~20x its compute to cross a 100 Mbit/s link (on GPUs, any preset is
link-bound at that rate; on 2 CPU cores only this one is), and `sites` the same model on
4 workers in 2 sites of 2 (`--sites`, train/sites.py): HSDP AdamW's gradient crosses the
100 Mbit/s link between the sites once per step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import TypeVar

from .settings import DeMoSettings, Settings, flat_fields, with_flat

S = TypeVar("S", bound=Settings)


@dataclass(frozen=True)
class TrainConfig:
    """Model, data and schedule of one run (every worker builds the same from it)."""

    name: str = "small"
    model: str = "gpt"           # gpt (train/model.py), a transformers family (llama, qwen2, mistral, gpt2) or a config.json
    init_from: str | None = None  # a transformers model: start from the safetensors weights in this directory
    workers: int = 4             # worker processes the preset is sized for (--workers overrides)
    sites: int = 0               # two tiers: sites of workers/sites ranks (FSDP2 inside); 0: flat
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    context: int = 64
    vocab_size: int = 256
    rows: int = 32               # global batch: windows per step, split across workers
    steps: int = 300
    eval_every: int = 25
    eval_rows: int = 256         # validation windows, fixed for the whole run
    warmup_frac: float = 0.05    # linear warmup, then cosine to min_lr_frac * lr
    min_lr_frac: float = 0.1
    seed: int = 0
    lr: float | None = None      # None: the optimizer's registered default for this preset
    sync_every: int = 32         # LoRDO, DiLoCo and SparseLoCo: local steps between synchronisations
    sync_delay: int = 0          # diloco-delayed, sparseloco-delayed: steps a sync stays in flight (0: sync_every)
    optimizer_settings: tuple[Settings, ...] = ()  # each optimizer's own (train/settings.py); absent: its defaults
    overlap: bool = False        # thinwire optimizers: overlap=True (each step's exchange in flight during the next compute)

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_frac * self.steps))

    def settings(self, cls: type[S]) -> S:
        """This run's settings of one optimizer (`cls`, e.g. DeMoSettings): given, or its defaults."""
        return next((s for s in self.optimizer_settings if type(s) is cls), None) or cls()

    def with_settings(self, **flat) -> TrainConfig:
        """This config with optimizer settings set by their flat keys (demo_topk=15, ...)."""
        return replace(self, optimizer_settings=with_flat(self.optimizer_settings, flat))

    def record(self) -> dict:
        """Every field as plain data, each optimizer's settings under its flat keys (a
        checkpoint's `config`: what a resumed run must match)."""
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "optimizer_settings"}
        return {**plain, **{key: getattr(self.settings(cls), name) for key, (cls, name) in flat_fields().items()}}


@dataclass(frozen=True)
class RunOptions:
    """How `thinwire train` / `thinwire compare` run a `TrainConfig`: on how many workers,
    over which link, what they write and report (train/run.py's `compare`; every worker of a
    run gets the same, train/worker.py's `train_worker`)."""

    workers: int | None = None
    """Worker processes; None: the preset's (`TrainConfig.workers`)."""

    out_dir: str | None = None
    """Directory of the logs, summary.json, table.md and plots; None: a fresh temporary one."""

    link: str | None = None
    """Emulated slow link between workers (between sites under --sites), e.g. "100mbit,20ms"."""

    latency_s: float | None = None
    """Per-collective latency of modelled time; None: the link's delay, else run.DEFAULT_LATENCY_S."""

    target: float | None = None
    """Target validation loss; None: the dense baseline's final one x 1.02."""

    data: str | None = None
    """Text file, directory of files, .jsonl/.json or .parquet file (records with a text field) or
    .bin of token ids; None: the stdlib's source (train/data.py, train/corpus.py)."""

    tokenizer: str | None = None
    """A local tokenizer.json (or a directory holding one); None: byte-level tokens."""

    text_field: str = "text"
    """The field of JSONL / Parquet records that holds a document's text."""

    data_cache: str | None = None
    """Where tokenised corpora are cached; None: $THINWIRE_CACHE or ~/.cache/thinwire/corpora."""

    quiet: bool = False
    """No progress bars."""

    lrs: dict[str, float] | None = None
    """Base learning rate per optimizer name (a sweep's); it wins over --lr and the registry's."""

    show: bool = True
    """Print the table and where the logs are."""

    checkpoint: bool = False
    """`thinwire train` (one optimizer): with `out_dir`, checkpoint under <out>/checkpoint/ and
    resume from the latest complete checkpoint there (train/checkpoint.py)."""

    checkpoint_every: int = 0
    """Steps between checkpoints; 0: a checkpoint at the end only."""

    peer_timeout: float | None = None
    """Seconds a collective waits for a silent peer before every survivor raises; None:
    launch.DEFAULT_PEER_TIMEOUT."""

    adamw_probe: bool = True
    """Time dense AdamW's step in a single-tier non-DDP run (train/probe.py): on a copy of the model
    held for the run, before and after training and 3 steps at every evaluation, outside the timed
    steps. False (`--no-adamw-probe`): no copy and no probing (a large model's memory and wall
    time); the limits table's last column is then empty."""

    dense_steps: int | None = None
    """Dense AdamW's steps to `target`, from its own run, for a table without it: each row's time
    is then divided by these steps x AdamW's step timed in that row's run (report.add_limits)."""

    exchange: str | None = None
    """A store URL (file:///folder, s3://bucket/prefix): each worker a site whose optimizer's
    messages go through it, in agreed rounds (train/store_runs.py); None: torch.distributed."""

    round_timeout: float = 90.0
    """With `exchange`: seconds a round waits for every site before it closes without the late."""

    exchange_key: str | None = None
    """With `exchange`: the hex key that signs every message; None: THINWIRE_EXCHANGE_KEY, else
    `exchange_key_file`, else (one command, no `site`) drawn once per command."""

    exchange_key_file: str | None = None
    """With `exchange`: a file holding the hex signing key (--exchange-key-file)."""

    site: str | None = None
    """With `exchange`: this command runs one site of the run, its `workers` a local gloo world,
    everything across sites through the store (train/site_run.py); None: every worker here."""

    peers: tuple[str, ...] = ()
    """With `site`: every site of the run, this one included, the same list at every site."""

    snapshot_every: int = 0
    """With `exchange`: every this many rounds a site writes a snapshot to the store (its model,
    the optimizer's replicated state, its step and schedule), which a later site starts from
    (`join`); 0: none."""

    join_timeout: float = 600.0
    """With `exchange`: seconds the run's first round (and `site`'s settings check) waits for
    every site; then it starts without the missing ones, who may come later with `join`."""

    join: bool = False
    """With `site`: this site joins a run already going, from the store's latest snapshot (a
    site declared in `peers` that was not there at the start, or one that restarts)."""

    @property
    def writes_checkpoints(self) -> bool:
        """Whether the run checkpoints and resumes: `checkpoint` with an `out_dir`."""
        return self.checkpoint and bool(self.out_dir)


# Fields that became an optimizer's settings (train/settings.py): old name -> flat key. The CLI
# still takes the old flags (with a note), and a checkpoint written before reads as the new key.
RENAMED = {"topk": "demo_topk", "chunk": "demo_chunk", "alpha": "demo_alpha", "beta": "demo_beta",
           "values": "demo_values", "momentum_form": "demo_momentum_form", "rank": "powersgd_rank",
           "compressed_after": "apmsqueeze_compressed_after", "uplink": "ef21_muon_uplink", "lowrank": "lordo_rank"}


# One line per field for `--help` (the CLI's overrides).
FIELD_HELP = {
    "model": "gpt (the harness's own), llama, qwen2, mistral, gpt2 (transformers, sized by the preset) or the "
             "path of a config.json (used as it is); transformers models need the [hf] extra",
    "init_from": "a transformers model: start from the safetensors weights in this directory (same config)",
    "workers": "worker processes (default: the preset's, 4 except wan's 2)",
    "sites": "run the workers as S sites of workers/S ranks: FSDP2 inside a site, the optimizer across "
             "sites; with --link only traffic between sites crosses the slow link (0: flat)",
    "n_layer": "transformer blocks", "n_embd": "model width", "n_head": "attention heads",
    "context": "tokens per window", "vocab_size": "vocabulary (256 for bytes; set it for a .bin)",
    "rows": "global batch: windows per step, split across workers", "steps": "optimizer steps",
    "eval_every": "steps between validation evaluations", "eval_rows": "validation windows",
    "seed": "model init and data order", "lr": "base learning rate (default: the optimizer's swept value)",
    "sync_every": "LoRDO, DiLoCo and SparseLoCo: local steps between synchronisations",
    "sync_delay": "diloco-delayed and sparseloco-delayed: steps each sync stays in flight before it lands, "
                  "the replicas keeping their local steps (SparseLoCo's from its eager jump; 0: sync_every, a whole interval)",
    "overlap": "thinwire optimizers: leave each step's exchange in flight while the next step computes "
               "(overlap=True); refused for PowerSGD and the DDP baselines",
}


PRESETS = {
    "tiny": TrainConfig(name="tiny", n_layer=1, n_embd=64, n_head=2, context=32, rows=16, steps=60,
                        eval_every=10, eval_rows=64),
    # topk 58 with int8 values: the sweep's best loss at >= 100x fewer bytes than fp32 AdamW
    # the reference momentum at beta 0.99: +1.1 % vs AdamW over seeds 0-2, the EMA's best (beta
    # 0.98) +3.15 % (docs/results/2026-11-23-small-demo-ema-seeds.md)
    "small": TrainConfig(optimizer_settings=(DeMoSettings(topk=58, values="int8", beta=0.99,
                                                          momentum_form="reference"),)),
    "base": TrainConfig(name="base", n_layer=4, n_embd=256, n_head=8, context=128, rows=64, steps=1000,
                        eval_every=50, eval_rows=512),
    # Link-bound on 2 CPU cores: 3.7M parameters, one 64-token window per worker and step, so
    # AdamW's dense fp32 all-reduce (14.7 MB/step) takes ~26x its compute at 100 Mbit/s.
    # DeMo on 32x32 chunks (top 15 of 1024, about the density of top 58 of 4096): the same loss
    # there at half the DCT flops, and DeMo's compute is what its time to target is made of.
    "wan": TrainConfig(name="wan", workers=2, n_layer=2, n_embd=384, n_head=6, rows=2, steps=600,
                       optimizer_settings=(DeMoSettings(topk=15, chunk=32, values="int8"),)),
    # Two tiers: wan's model on 2 sites of 2 workers, one window per worker and step. HSDP
    # AdamW's gradient (14.7 MB fp32) crosses the 100 Mbit/s link between the sites each step,
    # ~1.2 s against ~0.2 s of compute (4 processes on 2 cores, FSDP2 inside each site).
    "sites": TrainConfig(name="sites", workers=4, sites=2, n_layer=2, n_embd=384, n_head=6, rows=4, steps=600,
                         optimizer_settings=(DeMoSettings(topk=15, chunk=32, values="int8"),)),
}


# A preset's fields that a transformers family changes (unless given): DeMo's top-k where the
# preset's does not send >= 100x fewer bytes than fp32 AdamW. Llama's SwiGLU MLP (352 wide at
# width 128: 64 x 44 chunks) and GQA k/v (32 x 64) hold fewer elements per chunk than GPT's
# 64 x 64, so the same top-k per chunk is denser. small, llama, seed 0: top 58 gives 78.7x fewer
# bytes at +0.005 % loss vs AdamW, top 44 102.8x at +1.43 %; qwen2 keeps 58: 100.6x at +2.98 %
# (docs/results/2026-11-24-hf-models.md).
FAMILY_DEFAULTS = {("small", "llama"): {"demo_topk": 44}}


def get_preset(name: str, **overrides) -> TrainConfig:
    """The preset `name` with its family's defaults (FAMILY_DEFAULTS, for overrides["model"]) and
    the non-None `overrides` applied: TrainConfig fields, and optimizer settings by their flat
    keys (demo_topk=15: train/settings.py); ValueError for unknown names and invalid values."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    plain = {f.name for f in fields(TrainConfig)} - {"optimizer_settings"}
    given = {**FAMILY_DEFAULTS.get((name, overrides.get("model")), {}),
             **{k: v for k, v in overrides.items() if v is not None}}
    unknown = set(given) - plain - set(flat_fields())
    if unknown:
        raise ValueError(f"unknown config fields: {sorted(unknown)}")
    cfg = replace(PRESETS[name], **{k: v for k, v in given.items() if k in plain})
    cfg = cfg.with_settings(**{k: v for k, v in given.items() if k not in plain})
    _check(cfg)
    return cfg


def _check(cfg: TrainConfig) -> None:
    """ValueError naming the first invalid field (an optimizer's settings: their own `check`)."""
    for key in ("workers", "n_layer", "n_embd", "n_head", "context", "rows", "steps", "eval_every", "eval_rows"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    for cls in Settings.KNOWN.values():
        cfg.settings(cls).check()
    if not 0 <= cfg.sync_delay <= cfg.sync_every:
        raise ValueError(f"sync_delay must be in [0, sync_every = {cfg.sync_every}], got {cfg.sync_delay}")
    if cfg.sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {cfg.sync_every}")
    if cfg.sites < 0:
        raise ValueError(f"sites must be >= 0 (0: flat), got {cfg.sites}")
    if cfg.init_from and cfg.model == "gpt":
        raise ValueError("--init-from loads transformers weights: give --model (a family or a config.json) too")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")


def check_sites(sites: int, workers: int) -> None:
    """ValueError unless `sites` (>= 1) divides `workers`: every site holds the same number of ranks."""
    if sites < 1 or workers % sites:
        raise ValueError(f"--sites must be a divisor of --workers ({workers}) so every site holds the same "
                         f"number of ranks, got {sites}")


# Bandwidths every run is modelled at (bits per second), in table order.
BANDWIDTHS = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6, "10mbit": 10e6, "1mbit": 1e6}

_RATE = re.compile(r"^\s*([0-9.]+)\s*(k|m|g)?(bit|bps)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([0-9.]+)\s*(us|ms|s)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """'100mbit' -> 1e8 bits/s (k, m, g prefixes; 'bit' or nothing; 'bps' also means bits)."""
    m = _RATE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 500kbit, got {text!r}")
    scale = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[(m.group(2) or "").lower() or None]
    return float(m.group(1)) * scale


def parse_time(text: str) -> float:
    """'20ms' -> 0.02 seconds."""
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"latency must look like 20ms, 500us or 0.1s, got {text!r}")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2).lower()]


def parse_link(text: str) -> tuple[float, float]:
    """'100mbit' or '100mbit,20ms' -> (bits per second, one-way latency in seconds)."""
    rate, _, delay = text.partition(",")
    return parse_rate(rate), (parse_time(delay) if delay else 0.0)
