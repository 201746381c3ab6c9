"""Qwen2.5-shaped model configs and random parameters for the tests (no checkpoint, no hub).

`random_params` under `jax.eval_shape` costs nothing, so the real sizes (0.5B ... 72B) can be
planned without their memory: `jax.eval_shape(lambda: random_params(qwen25_config("7B"), quant="nvfp4"))`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qerl_jax.models.qwen2 import ModelConfig, projection_shapes

# (vocab, hidden, intermediate, layers, heads, kv_heads, tied) from the public Qwen2.5 config.json files.
QWEN25_SHAPES = {
    "0.5B": (151936, 896, 4864, 24, 14, 2, True),
    "1.5B": (151936, 1536, 8960, 28, 12, 2, True),
    "3B": (151936, 2048, 11008, 36, 16, 2, True),
    "7B": (152064, 3584, 18944, 28, 28, 4, False),
    "14B": (152064, 5120, 13824, 48, 40, 8, False),
    "32B": (152064, 5120, 27648, 64, 40, 8, False),
    "72B": (152064, 8192, 29568, 80, 64, 8, False),
}


def qwen25_config(size: str) -> ModelConfig:
    """The ModelConfig of a Qwen2.5 size ("0.5B" ... "72B")."""
    vocab, d, inter, layers, heads, kv_heads, tied = QWEN25_SHAPES[size]
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d // heads,
        tie_word_embeddings=tied,
    )


def random_params(
    config: ModelConfig, *, quant: str | None = None, dtype=jnp.float32, seed: int = 0, std: float = 0.05
) -> dict[str, Any]:
    """{"base", "norms"} of random weights: `dtype` linears, or `quant` 4-bit packed ones (one
    layer quantized at a time); q/k/v biases where the config has them; unit norm scales."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    normal = lambda shape: std * jax.random.normal(next(keys), shape, dtype)  # noqa: E731
    n_layers, d = config.num_hidden_layers, config.hidden_size
    layers = {}
    for proj, (n, k) in projection_shapes(config).items():
        w = normal((n_layers, n, k))
        if quant is not None:
            from qerl_jax.quant import quantize  # noqa: PLC0415 (only for 4-bit bases)

            w = jax.lax.map(lambda one: quantize(one, quant), w)
        layers[proj] = {"w": w}
        if config.attention_bias and proj in ("q_proj", "k_proj", "v_proj"):
            layers[proj]["b"] = normal((n_layers, n))
    base = {"embed": normal((config.vocab_size, d)), "layers": layers}
    if not config.tie_word_embeddings:
        base["lm_head"] = normal((config.vocab_size, d))
    ones = lambda shape: jnp.ones(shape, dtype)  # noqa: E731
    norms = {
        "final_norm": ones((d,)),
        "layers": {"input_layernorm": ones((n_layers, d)), "post_attention_layernorm": ones((n_layers, d))},
    }
    return {"base": base, "norms": norms}
