"""Parameter shapes of reference models, for sizing messages without building the models."""

from __future__ import annotations


def gpt2_small() -> list[tuple[int, ...]]:
    """GPT-2 small (124M): vocab 50257, context 1024, 12 layers, width 768, tied head."""
    d, v, ctx = 768, 50257, 1024
    shapes: list[tuple[int, ...]] = [(v, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),        # ln_1, attn c_attn, c_proj
                   (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]    # ln_2, mlp c_fc, c_proj
    return shapes + [(d,), (d,)]                                         # ln_f


def olmo_1b() -> list[tuple[int, ...]]:
    """OLMo-1B: vocab 50304, 16 layers, width 2048, SwiGLU hidden 8192, no biases,
    non-parametric layer norms, tied embeddings."""
    d, v, hidden = 2048, 50304, 8192
    shapes: list[tuple[int, ...]] = [(v, d)]
    for _ in range(16):
        shapes += [(3 * d, d), (d, d), (2 * hidden, d), (d, hidden)]      # att_proj, attn_out, ff_proj, ff_out
    return shapes


MODELS = {"gpt2-small": gpt2_small, "olmo-1b": olmo_1b}
