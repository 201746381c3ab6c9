"""token_logprobs: chunked == unchunked == transformers' log_softmax at the next tokens."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_logits, left_padded_batch, make_hf_model, save_hf_model

import qerl_jax
from qerl_jax.lora import LoraConfig, init_lora, lora_scale
from qerl_jax.rl.logprobs import to_next_token_grid, to_token_aligned, token_logprobs


def _batch(vocab, b=3, t=13):
    return left_padded_batch(vocab, b, t, pads=(0, 4, 2))


def _hf_logp_entropy(model, ids, mask, temperature):
    logits = torch.from_numpy(hf_logits(model, ids, mask)).double()
    logprobs = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    target = torch.tensor(ids[:, 1:], dtype=torch.long)[..., None]
    logp = torch.gather(logprobs, -1, target)[..., 0]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp.numpy(), entropy.numpy()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_transformers_and_chunking_is_exact(tiny_qwen2_dir, temperature):
    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    ids, mask = _batch(config.vocab_size)
    fn = jax.jit(
        lambda i, m, c: token_logprobs(config, params, i, m, chunk_size=c, temperature=temperature),
        static_argnums=2,
    )
    full_lp, full_ent = fn(ids, mask, None)
    ref_lp, ref_ent = _hf_logp_entropy(model, ids, mask, temperature)
    real = (mask[:, :-1] * mask[:, 1:]).astype(bool)  # both the prefix end and the target are real tokens
    assert full_lp.shape == (3, 12) and full_lp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(full_lp)[real], ref_lp[real], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(full_ent)[real], ref_ent[real], atol=2e-4, rtol=1e-4)
    for chunk in (4, 5, 12):  # dividing, non-dividing (padded last chunk), one chunk
        lp, ent = fn(ids, mask, chunk)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(full_lp), atol=1e-6)
        np.testing.assert_allclose(np.asarray(ent), np.asarray(full_ent), atol=1e-6)


def test_tied_embeddings_use_embed_as_head(tmp_path):
    model = make_hf_model(tie_word_embeddings=True, num_key_value_heads=1)
    config, params = qerl_jax.load_model(save_hf_model(model, tmp_path), dtype="float32")
    assert "lm_head" not in params["base"]
    ids, mask = _batch(config.vocab_size, b=2, t=9)
    lp, _ = jax.jit(lambda i, m: token_logprobs(config, params, i, m, chunk_size=3))(ids, mask)
    ref, _ = _hf_logp_entropy(model, ids, mask, 1.0)
    real = (mask[:, :-1] * mask[:, 1:]).astype(bool)
    np.testing.assert_allclose(np.asarray(lp)[real], ref[real], atol=2e-4, rtol=1e-4)


def _largest_vocab_array(jaxpr, vocab):
    """Largest number of elements of any intermediate whose last axis is the vocabulary."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            if shape and shape[-1] == vocab:
                biggest = max(biggest, math.prod(shape))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    biggest = max(biggest, _largest_vocab_array(inner, vocab))
    return biggest


def test_chunked_gradient_matches_and_never_holds_full_logits(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    lcfg = LoraConfig(rank=4, alpha=8.0)
    lora = init_lora(jax.random.key(0), config, lcfg)
    lora = jax.tree.map(lambda x: x + 0.05, lora)  # B != 0 so every LoRA matrix gets a gradient
    ids, mask = _batch(config.vocab_size, b=2, t=17)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, 16)), jnp.float32)

    def loss(lo, chunk):
        lp, _ = token_logprobs(config, {**params, "lora": lo}, ids, mask, lora_scale=lora_scale(lcfg), chunk_size=chunk)
        return jnp.sum(lp * weights)

    grads = {c: jax.jit(jax.grad(loss), static_argnums=1)(lora, c) for c in (None, 4)}
    for g_full, g_chunk in zip(jax.tree.leaves(grads[None]), jax.tree.leaves(grads[4])):
        np.testing.assert_allclose(np.asarray(g_chunk), np.asarray(g_full), atol=1e-6, rtol=1e-4)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads[4])) > 0

    v = config.vocab_size
    full = _largest_vocab_array(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(lora, None).jaxpr, v)
    chunked = _largest_vocab_array(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(lora, 4).jaxpr, v)
    assert full >= 2 * 16 * v  # the unchunked path does hold [B, T-1, V] logits
    assert chunked <= 2 * 4 * v  # forward and backward only ever hold one [B, chunk, V] block


def test_alignment_helpers_round_trip():
    x = jnp.arange(12.0).reshape(2, 6)
    grid = to_next_token_grid(x)
    np.testing.assert_array_equal(np.asarray(grid), np.asarray(x)[:, 1:])
    back = to_token_aligned(grid)
    np.testing.assert_array_equal(np.asarray(back)[:, 1:], np.asarray(x)[:, 1:])
    np.testing.assert_array_equal(np.asarray(back)[:, 0], 0)


def test_bad_arguments(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(config, params, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4)), temperature=0.0)
    with pytest.raises(ValueError, match="seq >= 2"):
        token_logprobs(config, params, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)))
