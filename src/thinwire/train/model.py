"""A GPT-style decoder (nanoGPT's layout): token + position embeddings, pre-LayerNorm blocks
of causal self-attention and a 4x GELU MLP, a final LayerNorm and an output head tied to the
token embedding. No dropout and no biases, so every parameter is a matrix except the
LayerNorm weights, which is what compressors and Muon are designed for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd, bias=False)
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.ln2 = nn.LayerNorm(n_embd, bias=False)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.out = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """logits = GPT(cfg)(tokens[B, T]) -> [B, T, vocab]; `loss(tokens, targets)` is the mean
    next-token cross-entropy in nats."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.context, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight              # tied, as in GPT-2 / nanoGPT
        self.apply(self._init)
        for block in self.blocks:                        # GPT-2's scaled init of residual outputs
            for layer in (block.proj, block.out):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg) -> nn.Module:
    """`cfg.model`'s model, the same initial weights on every rank (the seed fixes them): the
    GPT above for "gpt", else a transformers causal LM (train/hf.py)."""
    if getattr(cfg, "model", "gpt") != "gpt":
        from .hf import build_hf_model
        return build_hf_model(cfg)
    torch.manual_seed(cfg.seed)
    return GPT(cfg)


def hidden_matrices(model: nn.Module) -> tuple[list, list]:
    """(hidden matrices, the rest), Muon's usual split, in `model.parameters()` order: the rest
    is every embedding table (token, position), the output head (tied or not) and every
    parameter of fewer than 2 dimensions (norm gains, biases). GPT-2's Conv1D weights are
    [in, out] matrices and count as hidden matrices like a Linear's [out, in]."""
    outside = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "head", None)
    if head is not None:
        outside |= {id(p) for p in head.parameters()}
    matrices = [p for p in model.parameters() if p.dim() == 2 and id(p) not in outside]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]
