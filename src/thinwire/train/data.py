"""Training data: byte-level tokens of local text, split train/validation, sharded by rank.

Sources (`load_corpus(path, vocab_size)`):
  * None: the embedded corpus, the Python standard library's own source — every `.py` file
    under `sysconfig.get_paths()['stdlib']` outside `test`/`tests` directories and
    site-packages, sorted by path. Nothing is downloaded.
  * a text file, or a directory of text files (read recursively, sorted by path): bytes.
  * a `.bin` file of uint16 token ids (nanoGPT's format); ids must be < vocab_size.
  * a directory that `corpus.prepare_corpus` wrote (its manifest.json): the token ids of
    JSONL / Parquet / text data, tokenised once in the launcher (byte-level or with a
    tokenizer.json), already split; ids must be < vocab_size. See corpus.py.
The split is by document for text (every 20th file is validation, so both halves span the
whole corpus) and by position for `.bin` (the last 5 %). Every global batch is drawn from
a generator seeded by (seed, step); rank r takes rows r, r+W, r+2W, ... of it, so the
union of the workers' shards is the same batch for every world size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .corpus import is_prepared, load_prepared
from .text_sources import BIN_VAL_FRAC, VAL_EVERY, check_ids, stdlib_files


def _split_files(files: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        (val if i % VAL_EVERY == VAL_EVERY - 1 else train).extend(path.read_bytes())
    as_ids = lambda b: torch.frombuffer(b, dtype=torch.uint8).long() if b else torch.zeros(0, dtype=torch.long)
    return as_ids(train), as_ids(val)


def _load_bin(path: Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = bytearray(path.read_bytes())
    if len(raw) % 2:
        raise ValueError(f"{path} has an odd number of bytes: not a .bin of uint16 token ids")
    ids = torch.frombuffer(raw, dtype=torch.uint16).to(torch.int64) if raw else torch.zeros(0, dtype=torch.long)
    check_ids(ids, vocab_size, path)
    cut = int(ids.numel() * (1 - BIN_VAL_FRAC))
    return ids[:cut], ids[cut:]


def load_corpus(path: str | None, vocab_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, validation ids) as int64 tensors; see the module docstring."""
    if path is None:
        return _split_files(stdlib_files())
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist")
    if p.suffix == ".bin":
        return _load_bin(p, vocab_size)
    if is_prepared(p):
        return load_prepared(p, vocab_size)
    if vocab_size < 256:
        raise ValueError(f"text data is byte-level and needs vocab_size >= 256, got {vocab_size}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        if not files:
            raise ValueError(f"data directory {path!r} holds no files")
        return _split_files(files)
    data = p.read_bytes()                      # one file: split by position instead
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(ids.numel() * (1 - BIN_VAL_FRAC))
    return ids[:cut], ids[cut:]


def check_corpus(train: torch.Tensor, val: torch.Tensor, context: int) -> None:
    for name, ids in (("training", train), ("validation", val)):
        if ids.numel() < context + 2:
            raise ValueError(f"the {name} split holds {ids.numel()} tokens, fewer than context + 2 = "
                             f"{context + 2}; give more data or a shorter --context")


def windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = ids[starts[:, None] + torch.arange(context + 1)]          # [rows, context + 1]
    return w[:, :-1], w[:, 1:]


def train_batch(ids: torch.Tensor, cfg, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the global batch of `cfg.rows` windows for `step`."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, ids.numel() - cfg.context - 1, (cfg.rows,), generator=gen)
    return windows(ids, starts[rank::world], cfg.context)


def val_starts(ids: torch.Tensor, cfg) -> torch.Tensor:
    """The fixed validation windows of a run (the same for every optimizer and world size)."""
    gen = torch.Generator().manual_seed(12345 + cfg.seed)
    return torch.randint(0, ids.numel() - cfg.context - 1, (cfg.eval_rows,), generator=gen)
