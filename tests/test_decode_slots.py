"""Decode-step attention over per-row cache slots (`qwen2.attend_decode_slots`, `DecodeSlots`) against
the model's masked full-cache `attention` and a numpy softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.models.qwen2 import DecoderLayer, DecodeSlots, ForwardOptions, ModelConfig, attend_decode_slots, attention
from qerl_jax.rollout import decode_attention_backend


def _case(b, s, kv_heads, groups, d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, kv_heads * groups, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, s, kv_heads, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, kv_heads, d), jnp.float32).astype(dtype)
    return q, k, v


def _numpy_reference(q, k, v, start, end):
    """Per row, per query head h: softmax over its slots [start, end) with KV head h // G; zeros if none."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, d = q.shape
    groups = h // k.shape[2]
    out = np.zeros((b, h, d))
    for row in range(b):
        if end[row] <= start[row]:
            continue
        for head in range(h):
            keys = k[row, start[row] : end[row], head // groups]
            scores = keys @ q[row, head] / np.sqrt(d)
            p = np.exp(scores - scores.max())
            out[row, head] = (p / p.sum()) @ v[row, start[row] : end[row], head // groups]
    return out


@pytest.mark.parametrize(
    "kv_heads, groups, d, dtype, atol",
    [
        (2, 4, 32, jnp.float32, 1e-5),
        (4, 7, 128, jnp.float32, 1e-5),
        (1, 1, 16, jnp.float32, 1e-5),
        (2, 3, 64, jnp.bfloat16, 3e-2),
    ],
)
def test_decode_attention_reads_only_each_rows_slots(kv_heads, groups, d, dtype, atol):
    """Ragged [start, end) per row (one from slot 0, one ending at the cache's last slot, a single
    slot, an empty row), GQA: equal to numpy over the valid slots and to the model's `attention`
    with the same mask; garbage outside the slots changes nothing."""
    b, s = 6, 40
    q, k, v = _case(b, s, kv_heads, groups, d, dtype)
    start = np.array([0, 5, 17, 39, 20, 12], np.int32)
    end = np.array([11, 40, 40, 40, 20, 13], np.int32)  # row 1, 2, 3 at the cache end; row 4 empty
    out = attend_decode_slots(q, k, v, jnp.asarray(start), jnp.asarray(end))
    assert out.shape == (b, kv_heads * groups, d) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), _numpy_reference(q, k, v, start, end), atol=atol)
    assert not np.asarray(out[4], np.float32).any()  # end <= start: zeros
    slots = np.arange(s)
    mask = (slots[None] >= start[:, None]) & (slots[None] < end[:, None])
    full = attention(q[:, None], k, v, jnp.asarray(mask)[:, None, :])[:, 0]
    live = end > start
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[live],
        np.asarray(full, np.float32)[live],
        atol=atol,
        rtol=1e-2 if atol > 1e-3 else 0,
    )
    outside = jnp.asarray(~mask)[:, :, None, None]
    k_junk = jnp.where(outside, 1e4, k.astype(jnp.float32)).astype(dtype)
    v_junk = jnp.where(outside, -1e4, v.astype(jnp.float32)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(attend_decode_slots(q, k_junk, v_junk, start, end)), np.asarray(out))


def test_decode_attention_backends():
    q, k, v = _case(2, 8, 2, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="unknown decode attention backend 'cuda'"):
        attend_decode_slots(q, k, v, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), backend="cuda")
    assert decode_attention_backend(None) == "xla"  # on CPU
    assert decode_attention_backend("pallas") == "pallas"
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        decode_attention_backend("flash")


def test_decoder_layer_decode_slots_step_equals_its_full_forward():
    """One `DecoderLayer` over a left-padded sequence (T tokens at once), against the same layer
    fed the last token alone with `DecodeSlots` at per-row positions, the earlier keys/values in a
    cache whose other slots hold garbage: the same output."""
    config = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    keys = iter(jax.random.split(jax.random.key(1), 16))
    d, hd = config.hidden_size, config.head_dim
    shapes = {"q_proj": (32, d), "k_proj": (16, d), "v_proj": (16, d), "o_proj": (d, 32), "gate_proj": (48, d)}
    shapes.update(up_proj=(48, d), down_proj=(d, 48))
    base = {name: {"w": 0.2 * jax.random.normal(next(keys), shape)} for name, shape in shapes.items()}
    norms = {"input_layernorm": jnp.ones(d), "post_attention_layernorm": jnp.ones(d)}
    variables = {"base": base, "norms": norms}
    layer = DecoderLayer(config, ForwardOptions())
    b, t, slots = 3, 7, 20
    lengths = np.array([7, 4, 1])  # real tokens at the end of the T columns (left padding)
    h = jax.random.normal(next(keys), (b, t, d))
    valid = jnp.asarray(np.arange(t)[None] >= (t - lengths)[:, None])
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    full, _ = layer.apply(variables, h, None, positions, valid, 0)
    # The cache: each row's first len - 1 real tokens at slots [base, base + len - 1), garbage elsewhere.
    base_slot = np.array([3, 10, 19])  # row 2's single token is written at the cache's last slot
    prompt_cache = (jnp.zeros((b, t, 2, hd)),) * 2
    _, (k_all, v_all) = layer.apply(variables, h, prompt_cache, positions, valid, 0)
    junk = 100.0 * jax.random.normal(next(keys), (2, b, slots, 2, hd))
    k_cache, v_cache = junk[0], junk[1]
    for row in range(b):
        n = lengths[row] - 1
        src = slice(t - lengths[row], t - 1)
        k_cache = k_cache.at[row, base_slot[row] : base_slot[row] + n].set(k_all[row, src])
        v_cache = v_cache.at[row, base_slot[row] : base_slot[row] + n].set(v_all[row, src])
    write = jnp.asarray(base_slot + lengths - 1)
    step = DecodeSlots(write_B=write, start_B=jnp.asarray(base_slot), end_B=write + 1)
    last_pos = positions[:, -1:]
    out, (k_new, _) = layer.apply(variables, h[:, -1:], (k_cache, v_cache), last_pos, None, step)
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(full[:, -1]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(k_new[jnp.arange(b), write]), np.asarray(k_all[:, -1]), atol=1e-6)


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 0.1)])
def test_one_row_decode_step_over_fused_weights_equals_the_per_projection_layer(dtype, atol):
    """A one-row decode step over the rollout's fused weights (q/k/v and gate/up with their
    adapters' A below the rows, biases, norm scales other than 1) takes the norm in parts around
    the matmuls (`rms_norm_parts`); it gives what the layer over one weight per projection gives
    (the exact norm first): float32 to rounding, bf16 within its rounding (outputs of size ~3).
    With `decode_norm_parts` off the norm stays whole."""
    from unittest import mock

    from qerl_jax.linear import Fused, stack_loras
    from qerl_jax.models import qwen2

    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=128,
    )  # fmt: skip
    keys = iter(jax.random.split(jax.random.key(3), 32))
    d, hd, r = config.hidden_size, config.head_dim, 2
    shapes = {"q_proj": (32, d), "k_proj": (16, d), "v_proj": (16, d), "o_proj": (d, 32), "gate_proj": (48, d)}
    shapes.update(up_proj=(48, d), down_proj=(d, 48))
    normal = lambda shape, s=1.0: (s * jax.random.normal(next(keys), shape)).astype(dtype)  # noqa: E731
    base = {name: {"w": normal(shape, 0.2)} for name, shape in shapes.items()}
    for name in ("q_proj", "k_proj", "v_proj"):
        base[name]["b"] = normal(shapes[name][:1], 0.5)
    lora = {name: {"a": normal((r, shape[1]), 0.3), "b": normal((shape[0], r), 0.3)} for name, shape in shapes.items()}
    norms = {"input_layernorm": 1 + normal((d,), 0.3), "post_attention_layernorm": 1 + normal((d,), 0.3)}
    per_projection = {"base": base, "norms": norms, "lora": lora}
    fused_base, fused_lora = {n: dict(p) for n, p in base.items()}, dict(lora)
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        sizes = tuple(shapes[n][0] for n in group)
        stacked = stack_loras([lora[n] for n in group], sizes)
        w = jnp.concatenate([base[n]["w"] for n in group] + [stacked["a"]])
        for n in group:
            del fused_base[n]["w"]
        fused_base[qwen2.fused_name(group)] = {"w": Fused(w, sizes, max_rows=64, lora_rows=len(group) * r)}
        fused_lora[qwen2.fused_name(group)] = stacked
    fused = {"base": fused_base, "norms": norms, "lora": fused_lora}

    layer = DecoderLayer(config, ForwardOptions(lora_scale=0.5))
    slots = 6
    cache = tuple(normal((1, slots, 2, hd)) for _ in range(2))
    step = DecodeSlots(write_B=jnp.array([4]), start_B=jnp.array([1]), end_B=jnp.array([5]))
    h, position = normal((1, 1, d), 3.0), jnp.array([[3]])
    want, _ = layer.apply(per_projection, h, cache, position, None, step)
    with mock.patch.object(qwen2, "rms_norm_parts", wraps=qwen2.rms_norm_parts) as parts:
        got, _ = layer.apply(fused, h, cache, position, None, step)
    assert parts.call_count == 2  # both norms of the layer
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=0)
    whole_norms = DecoderLayer(config, ForwardOptions(lora_scale=0.5, decode_norm_parts=False))
    with mock.patch.object(qwen2, "rms_norm_parts", wraps=qwen2.rms_norm_parts) as parts:
        whole, _ = whole_norms.apply(fused, h, cache, position, None, step)
    assert parts.call_count == 0
    np.testing.assert_allclose(np.asarray(whole, np.float32), np.asarray(want, np.float32), atol=atol, rtol=0)
