"""`--model`: transformers families sized by the preset, a config.json as it is, `--init-from`
local weights, the hidden-matrix split every Muon-style optimizer uses, and the errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from thinwire.train.config import get_preset
from thinwire.train.settings import DeMoSettings
from thinwire.train.hf import check_model, family_config, kv_heads, mlp_width
from thinwire.train.model import build_model, hidden_matrices


def test_family_proportions_reproduce_the_published_models():
    """The ratios give the published widths: Llama-2-7B's 11008, Mistral-7B's 14336,
    Qwen2-0.5B's 4864 MLPs; Llama 3 / Mistral's 8 k/v heads for 32 query heads."""
    assert mlp_width("llama", 4096) == 11008
    assert mlp_width("mistral", 4096) == 14336
    assert mlp_width("qwen2", 896) == 4864
    assert kv_heads(32) == 8 and kv_heads(4) == 1 and kv_heads(6) == 1 and kv_heads(12) == 3


@pytest.mark.parametrize("family, tied", [("llama", False), ("mistral", False), ("qwen2", True), ("gpt2", True)])
def test_family_sized_by_the_preset(family, tied):
    cfg = get_preset("small", model=family)
    model = build_model(cfg)
    assert model(torch.randint(0, 256, (2, cfg.context))).shape == (2, cfg.context, 256)
    assert len(model.blocks) == cfg.n_layer
    assert (model.head.weight is model.lm.get_input_embeddings().weight) == tied
    config = family_config(cfg)
    if family != "gpt2":              # GQA: k/v project to kv_heads x head_dim rows
        k_proj = model.lm.model.layers[0].self_attn.k_proj.weight
        assert k_proj.shape == (kv_heads(cfg.n_head) * cfg.n_embd // cfg.n_head, cfg.n_embd)
        assert config.intermediate_size == mlp_width(family, cfg.n_embd)


def test_the_seed_fixes_the_init():
    a, b, c = (build_model(get_preset("tiny", model="llama", seed=s)) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_hidden_matrices_of_gpt_are_its_block_matrices():
    """The harness's GPT: everything 2-D but the token and position tables (the head is tied)."""
    model = build_model(get_preset("tiny"))
    matrices, rest = hidden_matrices(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in matrices] == [n for n, p in model.named_parameters()
                                                if p.dim() == 2 and n not in ("wte.weight", "wpe.weight")]
    assert len(matrices) + len(rest) == len(list(model.parameters()))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hidden_matrices_leave_out_embeddings_head_and_vectors(family):
    model = build_model(get_preset("tiny", model=family))
    matrices, rest = hidden_matrices(model)
    names = {id(p): n for n, p in model.named_parameters()}
    outside = {"llama": ("embed_tokens", "lm_head"), "gpt2": ("wte", "wpe")}[family]
    assert all(p.dim() == 2 and not any(o in names[id(p)] for o in outside) for p in matrices)
    assert {names[id(p)] for p in rest if p.dim() == 2} == {n for n, p in model.named_parameters()
                                                           if any(o in n for o in outside)}
    assert len(matrices) == {"llama": 7, "gpt2": 4}[family] * 1     # tiny: one decoder layer


def test_a_config_json_is_used_as_it_is(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=500, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(tmp_path)
    cfg = get_preset("tiny", model=str(tmp_path / "config.json"))
    model = build_model(cfg)
    assert len(model.blocks) == 3 and model.lm.model.layers[0].mlp.up_proj.weight.shape == (80, 48)
    assert check_model(cfg) == 500                         # the vocabulary is the config's


def test_init_from_loads_local_weights(tmp_path):
    saved = build_model(get_preset("tiny", model="qwen2", seed=5))
    saved.lm.save_pretrained(tmp_path)
    cfg = get_preset("tiny", model="qwen2", init_from=str(tmp_path))
    check_model(cfg)
    loaded = build_model(cfg)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), loaded.parameters()))
    assert loaded.head.weight is loaded.lm.get_input_embeddings().weight      # still tied


def test_init_from_weights_of_another_config_is_refused(tmp_path):
    build_model(get_preset("tiny", model="llama", n_embd=32)).lm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--init-from .*do not fit.*embed_tokens.weight is \[256, 32\]"):
        check_model(get_preset("tiny", model="llama", init_from=str(tmp_path)))
    with pytest.raises(ValueError, match="no model.safetensors"):
        check_model(get_preset("tiny", model="llama", init_from=str(tmp_path / "nowhere")))


def test_bad_model_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown --model 'falcon'"):
        check_model(get_preset("tiny", model="falcon"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="no \"model_type\""):
        check_model(get_preset("tiny", model=str(tmp_path / "config.json")))
    with pytest.raises(ValueError, match="--init-from loads transformers weights"):
        get_preset("tiny", init_from=str(tmp_path))


def test_a_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r'needs transformers: pip install -c constraints.txt -e "\.\[hf\]"'):
        build_model(get_preset("tiny", model="llama"))


def test_family_defaults_apply_unless_given():
    topk = lambda cfg: cfg.settings(DeMoSettings).topk  # noqa: E731
    assert topk(get_preset("small", model="llama")) == 44           # FAMILY_DEFAULTS: >= 100x fewer bytes
    assert topk(get_preset("small", model="llama", demo_topk=58)) == 58
    assert topk(get_preset("small")) == topk(get_preset("small", model="qwen2")) == 58
    assert topk(get_preset("tiny", model="llama")) == topk(get_preset("tiny"))


def test_a_parameter_narrower_than_a_site_is_refused_before_any_worker(tmp_path):
    """GQA with one k/v head of 2 dims: k_proj is [2, 32], fewer rows than 3 ranks per site.
    HSDP AdamW shards it (FSDP2 pads); a thinwire optimizer on shards would find a rank with
    none of it, so the run is refused up front, naming the parameter."""
    from transformers import LlamaConfig

    from thinwire.train.run import check_run
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=16,
                num_key_value_heads=1, max_position_embeddings=32).save_pretrained(tmp_path)
    cfg = get_preset("tiny", model=str(tmp_path / "config.json"), sites=2, rows=12)
    check_run(cfg, ["adamw"], 6, None)
    with pytest.raises(ValueError, match=r"demo on FSDP2 shards: lm.model.layers.0.self_attn.k_proj.weight \[2, 32\] "
                                         r"has fewer rows than the 3 ranks of a site"):
        check_run(cfg, ["adamw", "demo"], 6, None)
    check_run(cfg, ["adamw", "demo"], 4, None)                  # 2 ranks per site: one row each
