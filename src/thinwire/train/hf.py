"""Hugging Face causal LMs in the harness (`--model`, the `[hf]` extra):

    thinwire compare --model llama --optimizers adamw,demo          # a family, sized by the preset
    thinwire train --model ./my-model/config.json --init-from ./my-model --optimizer demo

    model = build_hf_model(cfg)        # CausalLM: model(tokens[B, T]) -> logits [B, T, vocab]

`cfg.model` is a family name (FAMILIES) or the path of a local `config.json`, used as it is.
A family is sized by the preset's n_layer / n_embd / n_head / context / vocab_size with that
family's usual proportions (`family_config`). Weights are a random init fixed by `cfg.seed`
(the same on every rank, nothing downloaded), or, with `cfg.init_from`, the safetensors
weights in that local directory (which must match the config's shapes). Dropout is off in
the families, as in the harness's own GPT; a config.json keeps its own.

`transformers` is imported here only, when a run asks for a model other than `gpt`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

EXTRA = 'pip install -c constraints.txt -e ".[hf]"'
FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
# Grouped-query attention: one k/v head per GQA_GROUP query heads (Llama 3 and Mistral: 32 query
# heads, 8 k/v heads), or the largest divisor of n_head below that count.
GQA_GROUP = 4
# MLP width over model width: Llama's SwiGLU 8/3 (7B: 11008 / 4096 after rounding up), Mistral
# 7B's 3.5 (14336 / 4096), Qwen2-0.5B's 5.43 (4864 / 896); rounded up as Llama rounds (to a
# multiple of 256 at 7B), the multiple scaled down with the width (`mlp_width`).
MLP_RATIO = {"llama": 8 / 3, "mistral": 3.5, "qwen2": 4864 / 896}
MLP_MULTIPLE = 256


def transformers_module():
    """`transformers`, or a ValueError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--model other than gpt needs transformers: {EXTRA}") from None
    return transformers


def kv_heads(n_head: int) -> int:
    """k/v heads for n_head query heads: n_head / GQA_GROUP when that divides, else the largest
    divisor of n_head at most that (1 at worst)."""
    most = max(1, n_head // GQA_GROUP)
    return max(d for d in range(1, most + 1) if n_head % d == 0)


def mlp_width(family: str, n_embd: int) -> int:
    """The family's MLP width at model width n_embd, rounded up to a multiple of the largest
    power of two <= min(MLP_MULTIPLE, n_embd / 4) (Llama-2-7B: int(8/3 x 4096) -> 11008)."""
    multiple = 1 << (max(1, min(MLP_MULTIPLE, n_embd // 4)).bit_length() - 1)
    return -(-int(MLP_RATIO[family] * n_embd) // multiple) * multiple


def family_config(cfg):
    """The transformers config of family `cfg.model` at the preset's sizes:
      llama   GQA, SwiGLU 8/3 x, RMSNorm, RoPE, untied head (Llama 2/3);
      mistral GQA, SwiGLU 3.5 x, untied head, no sliding window at these contexts;
      qwen2   GQA with q/k/v biases, SwiGLU 5.43 x, head tied to the embedding (Qwen2-0.5B/1.5B);
      gpt2    MHA, 4 x GELU MLP with biases, LayerNorm, learned positions, tied head."""
    tf = transformers_module()
    size = dict(vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layer, hidden_size=cfg.n_embd,
                num_attention_heads=cfg.n_head, max_position_embeddings=cfg.context)
    if cfg.model == "gpt2":
        return tf.GPT2Config(vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                             n_positions=cfg.context, bos_token_id=None, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             tie_word_embeddings=True)
    common = dict(size, num_key_value_heads=kv_heads(cfg.n_head), intermediate_size=mlp_width(cfg.model, cfg.n_embd),
                  attention_dropout=0.0)
    if cfg.model == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if cfg.model == "mistral":
        return tf.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if cfg.model == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    raise ValueError(f"unknown --model {cfg.model!r}: gpt, {', '.join(FAMILIES)} or the path of a config.json")


def file_config(path: str):
    """The transformers config in a local config.json (or a directory holding one), as it is."""
    tf = transformers_module()
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"--model {path}: a directory without a config.json")
    try:
        raw = json.loads(p.read_text())
        return tf.AutoConfig.for_model(**raw) if "model_type" in raw else _no_type(p)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--model {path}: not a transformers config.json ({_first_line(err)})") from None


def _no_type(p: Path):
    raise ValueError(f"{p} has no \"model_type\"")


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def model_config(cfg):
    """The transformers config `cfg.model` names: a family's (sized by cfg) or a file's."""
    if cfg.model in FAMILIES:
        return family_config(cfg)
    if not Path(cfg.model).exists():
        raise ValueError(f"unknown --model {cfg.model!r}: gpt, {', '.join(FAMILIES)} or the path of a config.json")
    return file_config(cfg.model)


class CausalLM(nn.Module):
    """A transformers causal LM as the harness calls it: tokens [B, T] -> logits [B, T, vocab].
    `blocks` are its decoder layers (FSDP2's units under --sites), `head` its output layer."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def blocks(self) -> nn.ModuleList:
        n = self.lm.config.num_hidden_layers
        lists = [m for m in self.lm.base_model.children() if isinstance(m, nn.ModuleList) and len(m) == n]
        if len(lists) != 1:
            raise ValueError(f"cannot find the decoder layers of {type(self.lm).__name__}")
        return lists[0]

    @property
    def head(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits


def build_hf_model(cfg, device: str | torch.device | None = None) -> CausalLM:
    """The same initial weights on every rank: cfg.seed fixes the random init; cfg.init_from
    replaces it by that directory's safetensors weights. device="meta": shapes only."""
    tf = transformers_module()
    config = model_config(cfg)
    torch.manual_seed(cfg.seed)
    with torch.device(device or "cpu"):
        lm = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if cfg.init_from and str(device) != "meta":
        load_weights(lm, cfg.init_from)
    return CausalLM(lm)


def check_model(cfg) -> int:
    """Every error `build_hf_model(cfg)` would raise in a worker, raised here at the cost of a
    model on the meta device and the weights' headers; the model's vocabulary size."""
    lm = build_hf_model(cfg, device="meta").lm
    if cfg.init_from:
        _check_weights(lm, _weight_shapes(cfg.init_from), cfg.init_from)
    return lm.get_input_embeddings().weight.shape[0]


def _weight_files(directory: str) -> list[Path]:
    """model.safetensors in `directory`, or the shards its model.safetensors.index.json names."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    raise ValueError(f"--init-from {directory}: no model.safetensors (or model.safetensors.index.json) there")


def _weight_shapes(directory: str) -> dict[str, tuple]:
    from safetensors import safe_open
    shapes = {}
    for f in _weight_files(directory):
        with safe_open(str(f), framework="pt") as weights:
            shapes.update({k: tuple(weights.get_slice(k).get_shape()) for k in weights.keys()})
    return shapes


def load_weights(lm: nn.Module, directory: str) -> None:
    """Load the safetensors weights in `directory` into `lm` (a tied head takes the embedding's);
    ValueError naming what does not fit."""
    from safetensors.torch import load_file
    weights = {}
    for f in _weight_files(directory):
        weights.update(load_file(str(f)))
    _check_weights(lm, {k: tuple(v.shape) for k, v in weights.items()}, directory)
    lm.load_state_dict(weights, strict=False)
    lm.tie_weights()


def _check_weights(lm: nn.Module, shapes: dict[str, tuple], directory: str) -> None:
    own = {n: tuple(p.shape) for n, p in lm.named_parameters(remove_duplicate=False)}
    tied = set(own) - {n for n, _ in lm.named_parameters()}
    missing = sorted(set(own) - set(shapes) - tied)
    unknown = sorted(set(shapes) - set(own) - {n for n, _ in lm.named_buffers()})
    wrong = sorted(n for n in set(shapes) & set(own) if shapes[n] != own[n])
    problems = ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
               ([f"not in the model: {', '.join(unknown[:3])}"] if unknown else []) + \
               [f"{n} is {list(shapes[n])}, the model's {list(own[n])}" for n in wrong[:3]]
    if problems:
        raise ValueError(f"--init-from {directory}: the weights do not fit the model's config: {'; '.join(problems)}")
