"""Parity of our Flax Qwen2/Llama forward with transformers' PyTorch models on the same weights."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_logits, left_padded_batch, make_hf_model, save_hf_model

import qerl_jax
from qerl_jax.models.qwen2 import shift_rows

CONFIGS = {
    "gqa2_untied": dict(),
    "gqa1_tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "mha_odd_vocab": dict(num_key_value_heads=4, vocab_size=97),
}


def _batch(vocab, b=3, t=11, seed=0):
    """Random ids with left padding of different lengths per row (row 0 unpadded)."""
    return left_padded_batch(vocab, b, t, pads=(0, 3, 7), seed=seed)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("sharded", [False, True])
def test_float32_logits_match_transformers(tmp_path, name, sharded):
    model = make_hf_model(**CONFIGS[name])
    path = save_hf_model(model, tmp_path, shard_size="20KB" if sharded else None)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")) == sharded
    config, params = qerl_jax.load_model(path, dtype="float32")
    ids, mask = _batch(config.vocab_size)
    ours = np.asarray(qerl_jax.forward(config, params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(model, ids, mask)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    real = mask.astype(bool)  # padded positions are garbage in both implementations
    scale = np.abs(ref[real]).max()
    assert np.abs(ours[real] - ref[real]).max() < 1e-4 * scale


def test_llama_architecture_matches_transformers(tmp_path):
    model = make_hf_model("llama", attention_bias=False)
    path = save_hf_model(model, tmp_path)
    config, params = qerl_jax.load_model(path, dtype="float32")
    assert not config.attention_bias and "b" not in params["base"]["layers"]["q_proj"]
    ids, mask = _batch(config.vocab_size)
    ours = np.asarray(qerl_jax.forward(config, params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ours[real] - ref[real]).max() < 1e-4 * np.abs(ref[real]).max()


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
    )
    model = make_hf_model("llama", attention_bias=False, rope_scaling=scaling, rope_theta=500000.0)
    path = save_hf_model(model, tmp_path)
    config, params = qerl_jax.load_model(path, dtype="float32")
    ids, mask = _batch(config.vocab_size, t=40)
    ours = np.asarray(qerl_jax.forward(config, params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ours[real] - ref[real]).max() < 1e-4 * np.abs(ref[real]).max()


def test_bfloat16_logits_within_bf16_tolerance(tiny_qwen2_dir):
    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16")
    assert params["base"]["layers"]["q_proj"]["w"].dtype == jnp.bfloat16
    ids, mask = _batch(config.vocab_size)
    ours = np.asarray(qerl_jax.forward(config, params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(model, ids, mask)
    real = mask.astype(bool)
    rel = np.linalg.norm(ours[real] - ref[real]) / np.linalg.norm(ref[real])
    assert rel < 2e-2


def test_padding_does_not_change_real_tokens(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    ids, _ = _batch(config.vocab_size, b=1, t=8)
    padded = np.concatenate([np.zeros((1, 5), np.int32), ids], axis=1)
    mask = np.concatenate([np.zeros((1, 5), np.int32), np.ones((1, 8), np.int32)], axis=1)
    plain = qerl_jax.forward(config, params, jnp.asarray(ids))
    left = qerl_jax.forward(config, params, jnp.asarray(padded), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(left)[:, 5:], np.asarray(plain), atol=1e-5, rtol=1e-5)


def _naive_greedy(config, params, ids, mask, steps):
    fwd = jax.jit(lambda i, m: qerl_jax.forward(config, params, i, m))
    for _ in range(steps):
        nxt = jnp.argmax(fwd(ids, mask)[:, -1], axis=-1).astype(jnp.int32)
        ids = jnp.concatenate([ids, nxt[:, None]], axis=1)
        mask = jnp.concatenate([mask, jnp.ones_like(mask[:, :1])], axis=1)
    return np.asarray(ids)


def test_greedy_20_tokens_match_transformers_generate(tiny_qwen2_dir):
    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    ids, mask = _batch(config.vocab_size, b=2, t=6)
    ours = _naive_greedy(config, params, jnp.asarray(ids), jnp.asarray(mask), 20)
    with torch.no_grad():
        ref = model.generate(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        ).numpy()
    np.testing.assert_array_equal(ours, ref)


def test_forward_rejects_bad_shapes(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    with pytest.raises(ValueError, match="input_ids"):
        qerl_jax.forward(config, params, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        qerl_jax.forward(config, params, jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 5), jnp.int32))


def test_config_fields_come_from_config_json(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, _ = qerl_jax.load_model(path, dtype="float32")
    raw = json.load(open(os.path.join(path, "config.json")))
    assert config.hidden_size == raw["hidden_size"]
    assert config.num_key_value_heads == raw["num_key_value_heads"]
    assert config.head_dim == raw["hidden_size"] // raw["num_attention_heads"]


def test_shift_rows_rotates_each_row():
    x = np.arange(12).reshape(2, 6)
    out = np.asarray(shift_rows(jnp.asarray(x), jnp.asarray([2, -1], jnp.int32)))
    np.testing.assert_array_equal(out, [[2, 3, 4, 5, 0, 1], [11, 6, 7, 8, 9, 10]])
    h = np.arange(24).reshape(2, 6, 2)  # trailing dims move with their position
    np.testing.assert_array_equal(
        np.asarray(shift_rows(jnp.asarray(h), jnp.asarray([1, 0])))[0, :, 1], [3, 5, 7, 9, 11, 1]
    )


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_flash_attention_forward_equals_the_masked_one(tmp_path, kv_heads):
    """attention="flash" (rows shifted so real tokens come first, causal + per-row key lengths)
    gives the masked attention's logits on left-, right- and both-side-padded rows (GQA and MQA)."""
    model = make_hf_model(num_key_value_heads=kv_heads)
    config, params = qerl_jax.load_model(save_hf_model(model, tmp_path), dtype="float32")
    ids, _ = _batch(config.vocab_size, b=4, t=11)
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    mask[1, 7:] = 0
    mask[2, :2] = 0
    mask[2, 9:] = 0
    masked = np.asarray(qerl_jax.forward(config, params, jnp.asarray(ids), jnp.asarray(mask)))
    flash = np.asarray(qerl_jax.forward(config, params, jnp.asarray(ids), jnp.asarray(mask), attention="flash"))
    real = mask.astype(bool)
    assert np.isfinite(flash).all()
    np.testing.assert_allclose(flash[real], masked[real], atol=1e-5 * np.abs(masked[real]).max())


def test_forward_rejects_unknown_attention_and_remat(tiny_qwen2_dir):
    config, params = qerl_jax.load_model(tiny_qwen2_dir[0], dtype="float32")
    ids = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="attention 'cudnn' is not supported"):
        qerl_jax.forward(config, params, ids, attention="cudnn")
    with pytest.raises(ValueError, match="remat 'some' is not supported"):
        qerl_jax.forward(config, params, ids, remat="some")
