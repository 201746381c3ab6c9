"""Random Qwen2.5-shaped models built directly on the device, for benchmarks.

    config = model_config("7B")                              # Qwen2.5-7B shapes
    params = random_params(config, quant="nvfp4", seed=0)    # {"base", "norms"}, layer-stacked
    batch = random_rl_batch(config, batch=8, seq_len=1024)   # a train-step batch (numpy)

Each projection's [L, N, K] stack is produced by one jitted `lax.map` over layers: a layer's
weight is drawn (N(0, 0.02^2), bfloat16) and, for a 4-bit format, quantized with
`qerl_jax.quant.quantize` inside the same iteration, so only one layer's dense matrix exists at a
time and a quantized model never holds all its bf16 weights. Embeddings / lm_head stay bf16
(the model reads them dense), norms are ones, q/k/v biases small random values.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.models.qwen2 import PROJECTIONS, ModelConfig, projection_shapes

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
# A tiny stand-in with the same structure (CPU smoke tests); K is a multiple of every format's block.
TINY_SHAPE = (512, 128, 256, 2, 4, 2, False)
DENSE = (None, "bf16")


def model_config(name: str) -> ModelConfig:
    """ModelConfig of a Qwen2.5 size ("0.5B" ... "72B", case-insensitive) or "tiny"."""
    key = {k.lower(): k for k in QWEN25_SHAPES}.get(name.lower())
    if key is None and name.lower() != "tiny":
        raise ValueError(f"unknown model size {name!r}; expected 'tiny' or one of {list(QWEN25_SHAPES)}")
    v, d, i, layers, heads, kv, tied = TINY_SHAPE if key is None else QWEN25_SHAPES[key]
    return ModelConfig(
        vocab_size=v,
        hidden_size=d,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d // heads,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tied,
        attention_bias=True,
        max_position_embeddings=32768,
    )


@functools.partial(jax.jit, static_argnames=("shape", "num_layers", "fmt", "std"))
def _random_stack(key: jax.Array, *, shape: tuple[int, int], num_layers: int, fmt: str | None, std: float):
    """[L, N, K] bf16 (fmt None) or a PackedWeight with leading L, one layer at a time."""

    def one_layer(k):
        w = jax.random.normal(k, shape, jnp.bfloat16) * jnp.bfloat16(std)
        if fmt is None:
            return w
        from qerl_jax.quant import quantize  # noqa: PLC0415 (only needed for 4-bit bases)

        return quantize(w, fmt)

    return jax.lax.map(one_layer, jax.random.split(key, num_layers))


@functools.partial(jax.jit, static_argnames=("shape", "std"))
def _random_dense(key: jax.Array, *, shape: tuple[int, ...], std: float):
    return jax.random.normal(key, shape, jnp.bfloat16) * jnp.bfloat16(std)


def random_params(
    config: ModelConfig, *, quant: str | None = "bf16", seed: int = 0, std: float = 0.02
) -> dict[str, Any]:
    """{"base", "norms"} of random weights on the default device (bf16 dense or `quant` 4-bit linears)."""
    fmt = None if quant in DENSE else quant
    key = jax.random.key(seed)
    shapes = projection_shapes(config)
    n_layers, d = config.num_hidden_layers, config.hidden_size
    layers = {}
    for i, proj in enumerate(PROJECTIONS):
        w = _random_stack(jax.random.fold_in(key, i), shape=shapes[proj], num_layers=n_layers, fmt=fmt, std=std)
        layers[proj] = {"w": jax.block_until_ready(w)}  # one projection's temporaries at a time
        if config.attention_bias and proj in ("q_proj", "k_proj", "v_proj"):
            layers[proj]["b"] = _random_dense(
                jax.random.fold_in(key, 100 + i), shape=(n_layers, shapes[proj][0]), std=std
            )
    base = {
        "embed": _random_dense(jax.random.fold_in(key, 200), shape=(config.vocab_size, d), std=std),
        "layers": layers,
    }
    if not config.tie_word_embeddings:
        base["lm_head"] = _random_dense(jax.random.fold_in(key, 201), shape=(config.vocab_size, d), std=std)
    norms = {
        "final_norm": jnp.ones((d,), jnp.bfloat16),
        "layers": {
            "input_layernorm": jnp.ones((n_layers, d), jnp.bfloat16),
            "post_attention_layernorm": jnp.ones((n_layers, d), jnp.bfloat16),
        },
    }
    return jax.block_until_ready({"base": base, "norms": norms})


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in a pytree (PackedWeight fields included)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def random_rl_batch(
    config: ModelConfig, *, batch: int, seq_len: int, prompt_len: int | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """A train-step batch (numpy): prompts of ~prompt_len tokens (left-padded by a few tokens on
    odd rows), responses up to seq_len (right-padded by a few on every third row), random
    old_logp on response tokens and random advantages."""
    prompt_len = prompt_len or seq_len // 4
    if not 1 <= prompt_len < seq_len:
        raise ValueError(f"need 1 <= prompt_len < seq_len; got prompt_len={prompt_len}, seq_len={seq_len}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int32)
    attn = np.ones((batch, seq_len), np.int32)
    resp = np.zeros((batch, seq_len), np.float32)
    resp[:, prompt_len:] = 1
    pad = min(8, prompt_len - 1)
    attn[1::2, :pad] = 0
    tail = min(8, seq_len - prompt_len - 1)
    if tail > 0:
        attn[::3, seq_len - tail :] = 0
    resp *= attn
    ids *= attn
    old = np.where(resp > 0, rng.uniform(-4.0, -0.1, (batch, seq_len)), 0.0).astype(np.float32)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "response_mask": resp,
        "old_logp": old,
        "advantages": rng.standard_normal(batch).astype(np.float32),
    }
