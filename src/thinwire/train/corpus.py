"""Your own data: JSONL, Parquet or text, tokenised once per corpus and cached as token ids.

    from thinwire.train.corpus import prepare_corpus
    from thinwire.train.data import load_corpus
    prep = prepare_corpus("data/", tokenizer="tokenizer.json", text_field="text")  # launcher, once
    train, val = load_corpus(prep.path, prep.vocab_size or cfg.vocab_size)          # every worker

Sources: a `.jsonl`/`.json` (JSON lines) or `.parquet` file, one document per record's
`text_field`, read with pyarrow; a text file or a directory of files (sorted by path; record
files give one document per record, any other file is one document); None, the stdlib corpus
(text_sources.py). Document i, counting across files, is validation when i % VAL_EVERY == VAL_EVERY - 1;
a single plain text file is one document, split by position like data.py does (last 5 %).

Tokens: with no tokenizer, UTF-8 bytes (vocab 256). With `tokenizer` (a local tokenizer.json,
or a folder holding one) the `tokenizers` library encodes documents in batches without its
template specials (no BOS), and appends an end-of-document id after every document when it
finds one: `eos_token` of a tokenizer_config.json beside the tokenizer.json (Hugging Face's own
record of it), else the first of EOS_NAMES that the tokenizer holds as a special token, else
none. The vocabulary is tokenizer.get_vocab_size() (or one more than its largest id, if ids
have gaps).

Cache: `<cache_dir>/<key>/` holds train.npy and val.npy (uint16 ids, uint32 when the vocabulary
exceeds 65535) and manifest.json, written last into a temporary directory that is then renamed
into place, so a half-written cache is never seen. The key hashes each source file's resolved
path, size and mtime_ns, the tokenizer file's sha256, the end-of-document id, text_field, the
split rule and FORMAT_VERSION. cache_dir defaults to $THINWIRE_CACHE or ~/.cache/thinwire/corpora.
pyarrow and tokenizers are optional (the hf extra) and imported only when needed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .text_sources import BIN_VAL_FRAC, VAL_EVERY, check_ids, stdlib_files

FORMAT, FORMAT_VERSION, MANIFEST = "thinwire-corpus", 1, "manifest.json"
RECORDS = {".jsonl": "JSONL", ".json": "JSONL", ".parquet": "Parquet"}
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
BATCH = 1024                       # documents per encode_batch call and per pyarrow batch
JSON_BLOCK = 16 << 20              # pyarrow's JSON block; a longer line (document) retries with more
EXTRA = 'pip install -c constraints.txt -e ".[hf]"'


@dataclass(frozen=True)
class Prepared:
    """What the launcher hands its workers: `path` for load_corpus, and the tokenizer's
    vocabulary (None: byte-level or untouched data, keep the configured vocab_size)."""
    path: str | None
    vocab_size: int | None = None
    reused: bool = False           # True when an existing cache served, with no tokenising


@dataclass(frozen=True)
class _Tokenizer:
    tok: object
    path: Path
    sha256: str
    vocab_size: int
    eos_id: int | None


def default_cache_dir() -> Path:
    return Path(os.environ.get("THINWIRE_CACHE") or Path.home() / ".cache" / "thinwire" / "corpora")


def _need(module: str, purpose: str):
    # The root package first: a cached submodule would otherwise import without it.
    try:
        importlib.import_module(module.split(".")[0])
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{purpose} needs the optional extra: {EXTRA}") from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def load_tokenizer(path: str | os.PathLike) -> _Tokenizer:
    """A local tokenizer.json (or a folder holding one), checked; nothing is downloaded."""
    Tokenizer = _need("tokenizers", "a tokenizer").Tokenizer
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"tokenizer file {str(p)!r} does not exist")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as err:       # tokenizers raises a bare Exception for bad JSON or schema
        raise ValueError(f"{p} is not a valid tokenizer.json: {_first_line(err)}") from None
    largest = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    return _Tokenizer(tok, p, hashlib.sha256(p.read_bytes()).hexdigest(),
                      max(tok.get_vocab_size(), largest + 1), _eos_id(tok, p))


def _eos_id(tok, path: Path) -> int | None:
    """See the module docstring: tokenizer_config.json's eos_token, else a known special name."""
    config = path.parent / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        eos = None                 # an unreadable config says nothing; fall back to the names
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return tok.token_to_id(eos)
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return next((special[name] for name in EOS_NAMES if name in special), None)


def _sources(data: str | None) -> list[Path]:
    if data is None:
        return stdlib_files()
    p = Path(data)
    if not p.exists():
        raise ValueError(f"data path {data!r} does not exist")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file())
    if not files:
        raise ValueError(f"data directory {data!r} holds no files")
    return files


def _check_field(schema, path: Path, field: str) -> None:
    pa = _need("pyarrow", "reading JSONL or Parquet")
    if field not in schema.names:
        raise ValueError(f"{path}: no field {field!r}; its fields are {', '.join(schema.names) or 'none'} "
                         f"(choose one with text_field / --text-field)")
    typ = schema.field(field).type
    is_view = getattr(pa.types, "is_string_view", lambda t: False)
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or is_view(typ)):
        raise ValueError(f"{path}: field {field!r} holds {typ} values, not strings")


def _texts(batches, path: Path, field: str) -> Iterator[list[str]]:
    offset = 0
    for batch in batches:
        texts = batch.column(0).to_pylist()
        if batch.column(0).null_count:
            raise ValueError(f"{path}: record {offset + texts.index(None)} has no string in field "
                             f"{field!r} (null or missing)")
        offset += len(texts)
        yield texts


def _read_json(reader, path: Path):
    """pyarrow.json.read_json with blocks large enough for the longest line: pyarrow refuses a
    line that straddles two blocks, and its default (1 MiB) is shorter than a long document."""
    pa, block = _need("pyarrow", "reading JSONL"), JSON_BLOCK
    while True:
        try:
            return reader.read_json(path, read_options=reader.ReadOptions(block_size=block))
        except pa.ArrowInvalid as err:
            if "straddling" not in str(err) or block >= min(path.stat().st_size, 2**31 - 1):
                raise
            block = min(block * 4, 2**31 - 1)


def _records(path: Path, kind: str, field: str) -> Iterator[list[str]]:
    """One JSONL or Parquet file's texts in batches; pyarrow's errors become one-line ValueErrors."""
    pa = _need("pyarrow", f"reading {kind}")
    reader = _need("pyarrow.json" if kind == "JSONL" else "pyarrow.parquet", f"reading {kind}")
    try:
        if kind == "JSONL":
            table = _read_json(reader, path)
            _check_field(table.schema, path, field)
            batches = table.select([field]).to_batches(BATCH)
        else:
            pf = reader.ParquetFile(path)
            _check_field(pf.schema_arrow, path, field)
            batches = pf.iter_batches(batch_size=BATCH, columns=[field])
        yield from _texts(batches, path, field)
    except (pa.ArrowException, OSError) as err:
        msg = _first_line(err)
        if f"Column(/{field})" in msg:          # pyarrow's JSON type inference met a non-string
            raise ValueError(f"{path}: field {field!r} is not a string in every record ({msg})") from None
        raise ValueError(f"unreadable {kind} {path}: {msg}") from None


def _documents(path: Path, field: str) -> Iterator[list]:
    """Batches of one file's documents: str per record, or the file's bytes as one document."""
    kind = RECORDS.get(path.suffix.lower())
    if kind is None:
        yield [path.read_bytes()]
    elif path.stat().st_size:                   # pyarrow calls an empty file an error: no documents
        yield from _records(path, kind, field)


def _encode(docs: list, tok: _Tokenizer | None) -> list[np.ndarray]:
    if tok is None:                              # byte-level: text files keep their raw bytes
        return [np.frombuffer(d if isinstance(d, bytes) else d.encode("utf-8"), dtype=np.uint8) for d in docs]
    texts = [d.decode("utf-8", "replace") if isinstance(d, bytes) else d for d in docs]
    tail = [] if tok.eos_id is None else [tok.eos_id]
    return [np.array(e.ids + tail, dtype=np.uint32) for e in tok.tok.encode_batch(texts, add_special_tokens=False)]


class _Say:
    """Progress on stderr: at most a line every 2 s (so big corpora stay readable), plus forced ones."""
    def __init__(self, enabled: bool):
        self.enabled, self.last = enabled, time.monotonic()

    def __call__(self, msg: str, force: bool = False) -> None:
        if self.enabled and (force or time.monotonic() - self.last >= 2.0):
            self.last = time.monotonic()
            print(f"thinwire: {msg}", file=sys.stderr, flush=True)


def _cat(arrays: list) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)


def _tokenise(sources: list[Path], field: str, tok: _Tokenizer | None, by_position: bool,
              say: _Say) -> tuple[np.ndarray, np.ndarray, int]:
    """(train ids, validation ids, documents), in order across files. Each batch is joined at
    once, so a corpus of millions of documents does not hold an array per document."""
    train, val, docs = [], [], 0
    for n, path in enumerate(sources, 1):
        for batch in _documents(path, field):
            encoded = _encode(batch, tok)
            is_val = [not by_position and (docs + i) % VAL_EVERY == VAL_EVERY - 1 for i in range(len(encoded))]
            train.append(_cat([ids for ids, v in zip(encoded, is_val) if not v]))
            val.append(_cat([ids for ids, v in zip(encoded, is_val) if v]))
            docs += len(encoded)
            say(f"tokenising file {n}/{len(sources)} {path}: {docs:,} documents so far")
    train, val = _cat(train), _cat(val)
    if by_position:                             # one plain text file: the last 5 %, as data.py
        cut = int(train.size * (1 - BIN_VAL_FRAC))
        train, val = train[:cut], train[cut:]
    return train, val, docs


def _check_splits(train: np.ndarray, val: np.ndarray, docs: int, name: str) -> None:
    if docs == 0:
        raise ValueError(f"{name}: no documents")
    if train.size + val.size == 0:
        raise ValueError(f"{name}: {docs} documents but no tokens")
    for split, ids in (("training", train), ("validation", val)):
        if ids.size == 0:
            raise ValueError(f"{name}: the {split} split is empty ({docs} documents; document i is "
                             f"validation when i % {VAL_EVERY} == {VAL_EVERY - 1}): give more data")


def _cache_key(sources: list[Path], tok: _Tokenizer | None, field: str, by_position: bool) -> str:
    files = [(str(f.resolve()), st.st_size, st.st_mtime_ns) for f in sources for st in [f.stat()]]
    what = {"version": FORMAT_VERSION, "files": files, "tokenizer": tok and tok.sha256,
            "eos_id": tok and tok.eos_id, "text_field": field, "split": [by_position, VAL_EVERY, BIN_VAL_FRAC]}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def write_prepared(dest: str | os.PathLike, train: np.ndarray, val: np.ndarray, vocab_size: int, meta: dict) -> None:
    """Write a prepared corpus atomically: a temporary directory, the manifest last, one rename."""
    dtype, dest = (np.uint32 if vocab_size > 65535 else np.uint16), Path(dest)
    top = max(int(train.max(initial=0)), int(val.max(initial=0)))
    if top >= vocab_size:                      # the cast below would wrap it silently
        raise ValueError(f"token id {top} >= vocab_size {vocab_size}: not writing {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        np.save(tmp / "train.npy", train.astype(dtype))
        np.save(tmp / "val.npy", val.astype(dtype))
        manifest = {**meta, "format": FORMAT, "version": FORMAT_VERSION, "vocab_size": vocab_size,
                    "dtype": np.dtype(dtype).name, "train_tokens": int(train.size), "val_tokens": int(val.size)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if dest.exists() and not is_prepared(dest):
            shutil.rmtree(dest)                # a leftover with no manifest: never a finished cache
        if not dest.exists():
            os.replace(tmp, dest)
    except OSError:
        if not is_prepared(dest):              # another launcher finishing first is fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _manifest(path: Path) -> dict | None:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


def is_prepared(path: str | os.PathLike) -> bool:
    """True when `path` is a directory that prepare_corpus finished (its manifest is there)."""
    return _manifest(Path(path)) is not None


def _prepared(path: Path, reused: bool) -> Prepared:
    m = _manifest(path)
    return Prepared(str(path), m["vocab_size"] if m.get("tokenizer") else None, reused)


def prepare_corpus(data: str | None, tokenizer: str | None = None, text_field: str = "text",
                   cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Prepared:
    """Tokenise `data` once (or reuse its cache) before any worker starts; see the module docstring.
    Data that needs nothing (None, byte-level text, a .bin, a prepared directory) comes back as it is."""
    if data is not None and is_prepared(data):
        return _prepared(Path(data), reused=True)
    sources = _sources(data)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    single = data is not None and Path(data).is_file()
    records = any(f.suffix.lower() in RECORDS for f in sources)
    if (single and Path(data).suffix == ".bin") or (tok is None and not records):
        return Prepared(data, tok.vocab_size if tok else None)   # .bin ids are tokens already
    by_position = single and not records
    root = Path(cache_dir or default_cache_dir()).expanduser().resolve()   # workers may start elsewhere
    dest = root / _cache_key(sources, tok, text_field, by_position)
    say = _Say(progress)
    if is_prepared(dest):
        say(f"using the cached tokens of {data} in {dest}", force=True)
        return _prepared(dest, reused=True)
    say(f"tokenising {data or 'the stdlib corpus'} ({len(sources)} file{'s' * (len(sources) != 1)}) with "
        f"{tok.path if tok else 'bytes'}", force=True)
    train, val, docs = _tokenise(sources, text_field, tok, by_position, say)
    _check_splits(train, val, docs, str(data or "the stdlib corpus"))
    write_prepared(dest, train, val, tok.vocab_size if tok else 256,
                   {"data": data, "tokenizer": tok and str(tok.path.resolve()), "eos_id": tok and tok.eos_id,
                    "text_field": text_field, "documents": docs, "files": len(sources)})
    say(f"{docs:,} documents, {train.size:,} + {val.size:,} tokens (train + validation) cached in {dest}", force=True)
    return _prepared(dest, reused=False)


def load_prepared(path: str | os.PathLike, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, validation ids) as int64 tensors from a prepared directory; ids < vocab_size."""
    path = Path(path)
    m = _manifest(path)
    if m is None or m.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a prepared corpus of format version {FORMAT_VERSION}: prepare it again")
    out = []
    for split in ("train", "val"):
        f = path / f"{split}.npy"
        try:
            ids = torch.from_numpy(np.load(f).astype(np.int64))
        except (OSError, ValueError) as err:
            raise ValueError(f"unreadable prepared corpus file {f}: {_first_line(err)}") from None
        check_ids(ids, vocab_size, f)
        out.append(ids)
    return out[0], out[1]
