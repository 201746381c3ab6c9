"""What the rollout engine's tests share (tests/test_sampler.py, test_weights.py, test_programs.py,
test_budget.py, test_batch.py): prompts, adapters, the engine's compile counts, a full-forward
recompute of the sampled log-probs, and the Hopper kernel faked by its CPU twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import stream_k_partials

import qerl_jax
from qerl_jax.models.qwen2 import PROJECTIONS
from qerl_jax.rollout import RolloutOptions, programs, to_train_batch, weights


def f32_options(**kw) -> RolloutOptions:
    """RolloutOptions with an exact (float32) KV cache, for the parity tests."""
    return RolloutOptions(cache_dtype=jnp.float32, **kw)


def compiled_programs() -> dict[str, int]:
    """How many programs of each kind jit holds compiled."""
    return {
        "prefill": programs.admit._cache_size(),
        "decode": programs.decode._cache_size(),
        "compact": programs.compact._cache_size(),
    }


def prompts(vocab: int, pads=(0, 3, 5), width: int = 9, seed: int = 0):
    """Left-padded random prompts; row i has pads[i] padding columns."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(len(pads), width)).astype(np.int32)
    mask = np.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def random_lora(config, rank: int = 4, seed: int = 1, scale: float = 0.3) -> dict:
    """float32 adapters on every projection (A and B random: the policy differs from the base)."""
    rng = np.random.default_rng(seed)
    d, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    dims = {
        "q_proj": (config.num_attention_heads * hd, d),
        "k_proj": (config.num_key_value_heads * hd, d),
        "v_proj": (config.num_key_value_heads * hd, d),
        "o_proj": (d, config.num_attention_heads * hd),
        "gate_proj": (ffn, d),
        "up_proj": (ffn, d),
        "down_proj": (d, ffn),
    }
    layers = {}
    for proj in PROJECTIONS:
        n, k = dims[proj]
        layers[proj] = {
            "a": jnp.asarray(rng.standard_normal((config.num_hidden_layers, rank, k)) * scale, jnp.float32),
            "b": jnp.asarray(rng.standard_normal((config.num_hidden_layers, n, rank)) * scale, jnp.float32),
        }
    return {"layers": layers}


def recomputed_logp(config, params, batch, temperature, lora_scale=1.0):
    """log_softmax(logits / T) of every token of the train batch under one full forward; with the
    sampled log-probs and the response mask, all [B, T - 1]."""
    train = to_train_batch(batch)
    forward = jax.jit(qerl_jax.forward, static_argnums=0, static_argnames="lora_scale")
    logits = forward(config, params, train["input_ids"], train["attention_mask"], lora_scale=lora_scale)
    logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
    gathered = jnp.take_along_axis(logp, train["input_ids"][:, 1:, None], axis=-1)[..., 0]
    return np.asarray(gathered), np.asarray(train["old_logp"][:, 1:]), np.asarray(train["response_mask"][:, 1:])


def assert_same_samples(a, b, name):
    """Two rollouts drew the same tokens, log-probs, lengths and truncation flags."""
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens), err_msg=name)
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths), err_msg=name)
    np.testing.assert_array_equal(np.asarray(a.truncated), np.asarray(b.truncated), err_msg=name)


def wgmma_cpu_twin(calls: list):
    """The Mosaic kernel's output, emulated: per-CTA partial sums of y.T x 2**-8 x global scale
    (each call's (x shape, launch parameters, n) appended to `calls`)."""
    from pallas_kernels import wgmma_nvfp4

    def twin(x, words, swords, *, n, tk, stages, wgs, ctas):
        calls.append((x.shape, dict(tk=tk, stages=stages, wgs=wgs, ctas=ctas), n))
        w = wgmma_nvfp4.dequantize_repacked(words, swords, jnp.float32) * 2.0**-8
        return stream_k_partials(w, x, tk=tk, wgs=wgs, ctas=ctas)[0]

    return twin


def fake_hopper_kernel(monkeypatch, calls: list, *, small_kv_dense: bool = True) -> None:
    """The wgmma kernel "available", replaced by its CPU twin; with `small_kv_dense`, k/v small
    enough for dense copies and every layer large enough for the kernel, as on 7B / 32B."""
    from pallas_kernels import wgmma_nvfp4

    monkeypatch.setattr(wgmma_nvfp4, "available", lambda: True)
    monkeypatch.setattr(wgmma_nvfp4, "wgmma_partials", wgmma_cpu_twin(calls))
    if small_kv_dense:
        monkeypatch.setattr(weights, "SMALL_DENSE_WEIGHTS", 64 * 128)
        monkeypatch.setattr(weights, "KERNEL_MIN_LAYER_WEIGHTS", 0)
