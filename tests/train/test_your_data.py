"""Your model and your data through the CLI: a transformers Llama trained on JSONL records
through a local tokenizer, SIGKILLed and re-run (it resumes bit for bit), and each bad input
refused in one line before any worker starts."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.train.shared import Forked, start, wait
from thinwire.train import cli
from thinwire.train.checkpoint import checkpoint_root, read_model

VOCAB = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """docs.jsonl (120 records of a few code-like lines) and a byte-level BPE tokenizer.json of
    VOCAB ids trained on them, both written here: nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("your-data")
    gen = torch.Generator().manual_seed(0)
    words = ["def", "return", "self", "value", "import", "for", "in", "range", "if", "else", "x", "y", "(", ")", ":"]
    docs = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (200,), generator=gen)) for _ in range(120)]
    with open(root / "docs.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return {"root": root, "data": root / "docs.jsonl", "tokenizer": root / "tokenizer.json",
            "vocab": tok.get_vocab_size()}


def _train(corpus: dict, out: Path, die: str | None = None) -> Forked:
    return start([sys.executable, "-m", "thinwire", "train", "--optimizer", "demo", "--model", "llama", "--preset",
                  "tiny", "--data", str(corpus["data"]), "--tokenizer", str(corpus["tokenizer"]), "--data-cache",
                  str(corpus["root"] / "cache"), "--steps", "8", "--eval-every", "4", "--eval-rows", "16",
                  "--workers", "2", "--quiet", "--out", str(out), "--checkpoint-every", "4"], die)


def _cached(corpus: dict, proc: Forked) -> list[Path]:
    """The cache's manifests once `proc` has written one: a cache is written in a hidden
    directory, its manifest last, then renamed into place, so a visible one is whole."""
    while not (manifests := [m for m in (corpus["root"] / "cache").glob("*/manifest.json")
                             if not m.parent.name.startswith(".")]):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    return manifests


def test_llama_on_tokenised_jsonl_killed_and_rerun_resumes_bit_for_bit(corpus, tmp_path):
    """The run never killed tokenises the records; the killed run starts from its cache, beside it."""
    first = _train(corpus, tmp_path / "whole")
    manifests = _cached(corpus, first)
    written = manifests[0].stat().st_mtime_ns
    killed = wait(_train(corpus, tmp_path / "killed", die="1:6"))    # rank 1 SIGKILLed as step 6 starts
    assert killed.returncode != 0
    rerun = _train(corpus, tmp_path / "killed")
    whole = wait(first)
    assert whole.returncode == 0, whole.stdout[-3000:]
    rerun = wait(rerun)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert len(manifests) == 1                                 # tokenised once, cached
    a = read_model(checkpoint_root(tmp_path / "whole") / "step-000008")
    b = read_model(checkpoint_root(tmp_path / "killed") / "step-000008")
    assert "lm.model.layers.0.self_attn.k_proj.weight" in a      # the transformers model was trained
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["lm.model.embed_tokens.weight"].shape[0] == corpus["vocab"]
    assert list((corpus["root"] / "cache").glob("*/manifest.json")) == manifests   # the cache served both
    assert manifests[0].stat().st_mtime_ns == written
    run = json.loads((tmp_path / "whole" / "summary.json").read_text())["runs"][0]
    assert run["config"]["vocab_size"] == corpus["vocab"] and run["config"]["model"] == "llama"


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_inputs_are_one_line_before_any_worker_starts(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    run = ["compare", "--preset", "tiny", "--optimizers", "adamw", "--quiet", "--out", str(out),
           "--data-cache", str(tmp_path / "cache")]
    no_field = tmp_path / "no-field.jsonl"
    no_field.write_text('{"body": "a"}\n' * 40)
    assert "no field 'text'; its fields are body" in _refused(run + ["--data", str(no_field)], capsys)
    assert "unknown --model 'falcon'" in _refused(run + ["--model", "falcon"], capsys)
    assert "tokenizer file" in _refused(run + ["--tokenizer", str(tmp_path / "none.json")], capsys)
    small = tmp_path / "small"                                # a config.json whose vocabulary is too small
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=32).save_pretrained(small)
    err = _refused(run + ["--model", str(small / "config.json"), "--data", str(corpus["data"]),
                          "--tokenizer", str(corpus["tokenizer"])], capsys)
    assert "train.npy holds token id" in err and ">= vocab_size 100" in err
    assert not out.exists() or not any(out.glob("*.jsonl"))   # no worker ever started
