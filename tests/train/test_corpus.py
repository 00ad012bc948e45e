"""corpus.py: JSONL / Parquet / text with a tokenizer.json, tokenised once and cached, its
errors, and load_corpus on the result. Everything is built here: files, tokenizers."""

import json
import sys

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

from thinwire.train import corpus                                        # noqa: E402
from thinwire.train.corpus import Prepared, prepare_corpus, write_prepared  # noqa: E402
from thinwire.train.data import VAL_EVERY, load_corpus                   # noqa: E402

EOS = "<|endoftext|>"
DOCS = [f"document {i}: the quick brown fox jumps over {i * 7} lazy dogs, café ünïcode ✓" for i in range(45)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A tiny byte-level BPE (vocab 300) with an end-of-text special token, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path, docs, field="text"):
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=16)
    return path


def expected(docs, encode):
    """The split rule computed independently: document i is validation when i % 20 == 19."""
    train = [t for i, d in enumerate(docs) if i % VAL_EVERY != VAL_EVERY - 1 for t in encode(d)]
    val = [t for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1 for t in encode(d)]
    return train, val


def bpe_encoder(path):
    tok = tokenizers.Tokenizer.from_file(str(path))
    eos = tok.token_to_id(EOS)
    return lambda d: tok.encode(d, add_special_tokens=False).ids + [eos]


def test_jsonl_and_parquet_give_the_tokenizers_ids(tmp_path, bpe):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    write_parquet(tmp_path / "b.parquet", DOCS)
    (tmp_path / "split").mkdir()                     # a directory: two files, counted across
    write_jsonl(tmp_path / "split" / "0.jsonl", DOCS[:27])
    write_parquet(tmp_path / "split" / "1.parquet", DOCS[27:])
    want = expected(DOCS, bpe_encoder(bpe))
    assert len(want[1]) and len(want[0]) > len(want[1])
    for data in ("a.jsonl", "b.parquet", "split"):
        prep = prepare_corpus(str(tmp_path / data), tokenizer=str(bpe), cache_dir=tmp_path / "cache", progress=False)
        assert prep.vocab_size == tokenizers.Tokenizer.from_file(str(bpe)).get_vocab_size() and not prep.reused
        train, val = load_corpus(prep.path, prep.vocab_size)
        assert train.dtype == val.dtype == torch.int64
        assert (train.tolist(), val.tolist()) == want, data


def test_byte_level_jsonl_is_utf8_and_text_files_take_a_tokenizer(tmp_path, bpe):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    prep = prepare_corpus(str(tmp_path / "a.jsonl"), cache_dir=tmp_path / "cache", progress=False)
    assert prep.vocab_size is None
    train, val = load_corpus(prep.path, 256)
    assert (train.tolist(), val.tolist()) == expected(DOCS, lambda d: list(d.encode("utf-8")))
    (tmp_path / "txt").mkdir()                       # a text directory: each file a document
    for i, d in enumerate(DOCS):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(d)
    prep = prepare_corpus(str(tmp_path / "txt"), tokenizer=str(bpe), cache_dir=tmp_path / "cache", progress=False)
    train, val = load_corpus(prep.path, prep.vocab_size)
    assert (train.tolist(), val.tolist()) == expected(DOCS, bpe_encoder(bpe))


def test_jsonl_lines_longer_than_pyarrows_block(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "JSON_BLOCK", 1 << 12)          # pyarrow refuses lines over a block
    docs = DOCS[:19] + ["x" * 100_000] + DOCS[20:]
    prep = prepare_corpus(str(write_jsonl(tmp_path / "a.jsonl", docs)), cache_dir=tmp_path / "c", progress=False)
    assert load_corpus(prep.path, 256)[1].numel() == 100_000 + len(DOCS[39].encode())


def test_data_needing_nothing_comes_back_unchanged(tmp_path):
    (tmp_path / "a.txt").write_text("plain bytes")
    (tmp_path / "ids.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    for data in (None, str(tmp_path / "a.txt"), str(tmp_path), str(tmp_path / "ids.bin")):
        assert prepare_corpus(data, cache_dir=tmp_path / "cache") == Prepared(path=data, vocab_size=None)
    assert not (tmp_path / "cache").exists()


def test_cache_is_reused_and_invalidated(tmp_path, bpe, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "a.jsonl", DOCS)
    first = prepare_corpus(str(data), tokenizer=str(bpe), cache_dir=tmp_path / "cache")
    assert "cached in" in capsys.readouterr().err
    manifest = tmp_path / "cache" / first.path.rsplit("/", 1)[1] / "manifest.json"
    assert json.loads(manifest.read_text())["documents"] == len(DOCS)
    stamp = manifest.stat().st_mtime_ns

    def no_tokenising(*args):
        raise AssertionError("tokenised again")
    with monkeypatch.context() as m:
        m.setattr(corpus, "_tokenise", no_tokenising)
        again = prepare_corpus(str(data), tokenizer=str(bpe), cache_dir=tmp_path / "cache", progress=False)
    assert again.path == first.path and again.reused and manifest.stat().st_mtime_ns == stamp
    write_jsonl(data, DOCS + ["one more document"])  # a changed file: a new key, tokenised anew
    changed = prepare_corpus(str(data), tokenizer=str(bpe), cache_dir=tmp_path / "cache", progress=False)
    assert changed.path != first.path and not changed.reused
    train, _ = load_corpus(changed.path, changed.vocab_size)
    assert train.tolist() == expected(DOCS + ["one more document"], bpe_encoder(bpe))[0]


def test_half_written_cache_is_not_used(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "a.jsonl", DOCS)
    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path / "env_cache"))
    first = prepare_corpus(str(data), progress=False)
    assert first.path.startswith(str(tmp_path / "env_cache"))
    (tmp_path / "env_cache" / first.path.rsplit("/", 1)[1] / "manifest.json").unlink()
    again = prepare_corpus(str(data), progress=False)
    assert again.path == first.path and not again.reused
    assert [p.name for p in (tmp_path / "env_cache").iterdir()] == [first.path.rsplit("/", 1)[1]]


def test_large_vocab_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))       # no end-of-document token: none appended
    write_jsonl(tmp_path / "a.jsonl", [f"w{69_999 - i} w{i}" for i in range(40)])
    prep = prepare_corpus(str(tmp_path / "a.jsonl"), tokenizer=str(tmp_path), cache_dir=tmp_path / "c", progress=False)
    assert prep.vocab_size == 70_000
    assert np.load(f"{prep.path}/train.npy").dtype == np.uint32
    train, val = load_corpus(prep.path, prep.vocab_size)
    assert train[:2].tolist() == [69_999, 0] and val.tolist() == [69_980, 19, 69_960, 39]
    write_prepared(tmp_path / "small", np.arange(40), np.arange(5), 300, {})
    assert np.load(tmp_path / "small" / "val.npy").dtype == np.uint16


def test_load_corpus_checks_ids_against_vocab(tmp_path):
    write_prepared(tmp_path / "p", np.arange(300), np.arange(20), 300, {"tokenizer": "t.json"})
    with pytest.raises(ValueError, match=r"train\.npy holds token id 299 >= vocab_size 256"):
        load_corpus(str(tmp_path / "p"), 256)
    assert load_corpus(str(tmp_path / "p"), 300)[1].tolist() == list(range(20))


BAD = {
    "missing field": ("a.jsonl", lambda p: write_jsonl(p, DOCS, field="body"),
                      r"a\.jsonl: no field 'text'; its fields are id, body"),
    "int field": ("a.jsonl", lambda p: p.write_text('{"text": 1}\n' * 30), r"a\.jsonl: field 'text' holds int64"),
    "mixed field": ("a.jsonl", lambda p: p.write_text('{"text": "a"}\n{"text": 2}\n'),
                    r"a\.jsonl: field 'text' is not a string in every record"),
    "null": ("b.parquet", lambda p: write_parquet(p, DOCS[:3] + [None]), r"b\.parquet: record 3 has no string"),
    "empty": ("a.jsonl", lambda p: p.write_text(""), r"a\.jsonl: no documents"),
    "no tokens": ("a.jsonl", lambda p: write_jsonl(p, [""] * 30), r"a\.jsonl: 30 documents but no tokens"),
    "empty split": ("a.jsonl", lambda p: write_jsonl(p, DOCS[:19]), r"the validation split is empty \(19 documents"),
    "corrupt parquet": ("b.parquet", lambda p: p.write_bytes(b"not parquet at all"),
                        r"^unreadable Parquet .*b\.parquet: Parquet magic bytes not found"),
    "corrupt jsonl": ("a.jsonl", lambda p: p.write_text('{"text": "a"\ngarbage\n'),
                      r"^unreadable JSONL .*a\.jsonl: JSON parse error"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_data_is_one_line_value_error(tmp_path, case):
    name, write, match = BAD[case]
    write(tmp_path / name)
    with pytest.raises(ValueError, match=match) as err:
        prepare_corpus(str(tmp_path / name), cache_dir=tmp_path / "cache", progress=False)
    assert "\n" not in str(err.value)


def test_bad_paths_and_tokenizers(tmp_path, bpe):
    data = str(write_jsonl(tmp_path / "a.jsonl", DOCS))
    with pytest.raises(ValueError, match="data path .*nowhere.jsonl' does not exist"):
        prepare_corpus(str(tmp_path / "nowhere.jsonl"), progress=False)
    with pytest.raises(ValueError, match="tokenizer file .*missing.json' does not exist"):
        prepare_corpus(data, tokenizer=str(tmp_path / "missing.json"), progress=False)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"bad\.json is not a valid tokenizer\.json: "):
        prepare_corpus(data, tokenizer=str(tmp_path / "bad.json"), progress=False)


def test_eos_comes_from_tokenizer_config_first(tmp_path, bpe):
    (tmp_path / "tokenizer.json").write_bytes(bpe.read_bytes())
    assert corpus.load_tokenizer(tmp_path).eos_id == 0                  # <|endoftext|> by name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "a"}}))
    tok = corpus.load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.eos_id == tok.tok.token_to_id("a") != 0


@pytest.mark.parametrize("module", ["pyarrow", "tokenizers"])
def test_missing_extra_names_the_install(tmp_path, bpe, monkeypatch, module):
    data = str(write_jsonl(tmp_path / "a.jsonl", DOCS))
    monkeypatch.setitem(sys.modules, module, None)                    # the import now fails
    with pytest.raises(ValueError, match=r'needs the optional extra: pip install -c constraints\.txt -e "\.\[hf\]"'):
        prepare_corpus(data, tokenizer=str(bpe), cache_dir=tmp_path / "cache", progress=False)
