"""The FP8 (E4M3) base copies and matmul (`qerl_jax.fp8`) against float32 / numpy references."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qerl_jax import fp8
from qerl_jax.linear import ByRows, LayerOf, base_matmul, fp8_train_base, linear
from qerl_jax.quant.packed import dequantize
from qerl_jax.quant import quantize

# Ragged shapes: no dimension a multiple of 16.
M, K, N = 37, 72, 50


def _np_quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy: per-row amax / 448 scales and the E4M3 values (as float64) of x / scale."""
    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = (x.astype(np.float32) / scale[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q, scale.astype(np.float64)


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def test_quantize_rows_matches_numpy_and_keeps_zero_rows():
    x = np.array(_rand(0, (M, K)))
    x[3] = 0.0
    q, s = fp8.quantize_rows(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    ref_q, ref_s = _np_quantize_rows(x)
    np.testing.assert_allclose(np.asarray(s, np.float64), ref_s, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32), np.float64), ref_q)
    assert np.all(np.asarray(q.astype(jnp.float32))[3] == 0) and float(s[3]) == 1.0
    # each row's largest value lands on 448, and the copy is within E4M3's half-ulp (2^-4) of x
    np.testing.assert_allclose(np.abs(ref_q).max(axis=1)[np.arange(M) != 3], 448.0)
    deq = ref_q * ref_s[:, None]
    assert np.all(np.abs(deq - x) <= 2.0**-4 * np.abs(x) + 2.0**-9 * ref_s[:, None])


def test_fp8_matmul_matches_float32_math_of_its_quantized_operands():
    x = _rand(1, (M, K))
    w = fp8.from_dense(_rand(2, (N, K), 0.05))
    out = jax.jit(fp8.fp8_matmul)(x, w)
    assert out.shape == (M, N) and out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
    xq, xs = _np_quantize_rows(np.asarray(x))
    wq, ws = _np_quantize_rows(np.asarray(_rand(2, (N, K), 0.05)))
    ref = (xq * xs[:, None]) @ (wq * ws[:, None]).T
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(out, fp8.reference_matmul(x, w), rtol=1e-5, atol=1e-6)


def test_fp8_error_against_the_bf16_path_is_bounded_on_nvfp4_weights():
    w_bf16 = _rand(3, (N, 64), 0.05).astype(jnp.bfloat16)  # K a multiple of NVFP4's block
    packed = quantize(w_bf16, "nvfp4")
    x = _rand(4, (M, 64)).astype(jnp.bfloat16)
    bf16_path = base_matmul(x, packed)  # dequantize to bf16 + bf16 dot
    fp8_path = base_matmul(x, fp8.from_packed(packed))
    rel = float(jnp.linalg.norm(fp8_path - bf16_path) / jnp.linalg.norm(bf16_path))
    assert 1e-3 < rel < 0.06, rel  # quantized (not the bf16 product), by E4M3's 3 mantissa bits only


def test_fp8_matmul_gradient_is_the_fp8_product_of_the_transposed_copy():
    x = _rand(5, (M, K))
    w_dense = _rand(6, (N, K), 0.05)
    w = fp8.from_dense(w_dense, transposed=True)
    assert w.wt_KxN.shape == (K, N) and w.scale_K.shape == (K,)
    r = _rand(7, (M, N))
    grad = jax.jit(jax.grad(lambda x_: jnp.sum(r * fp8.fp8_matmul(x_, w))))(x)
    assert bool(jnp.all(jnp.isfinite(grad)))
    # the same math in numpy: the cotangent and W.T quantized per row, an exact product
    gq, gs = _np_quantize_rows(np.asarray(r))
    wtq, wts = _np_quantize_rows(np.asarray(w_dense).T)
    ref = (gq * gs[:, None]) @ (wtq * wts[:, None]).T
    np.testing.assert_allclose(np.asarray(grad, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # and close to jax.grad of the float32 matmul (E4M3 rounding only)
    exact = jax.grad(lambda x_: jnp.sum(r * (x_ @ w_dense.T)))(x)
    assert float(jnp.linalg.norm(grad - exact) / jnp.linalg.norm(exact)) < 0.06


def test_fp8_gradient_without_a_transposed_copy_uses_the_dequantized_weight():
    x = _rand(8, (M, K)).astype(jnp.bfloat16)
    w = fp8.from_dense(_rand(9, (N, K), 0.05))
    r = _rand(10, (M, N))
    grad = jax.grad(lambda x_: jnp.sum(r * fp8.fp8_matmul(x_, w)))(x)
    assert grad.dtype == jnp.bfloat16
    w_deq = (w.w_NxK.astype(jnp.float32) * w.scale_N[:, None]).astype(jnp.bfloat16).astype(jnp.float32)
    ref = r.astype(jnp.bfloat16).astype(jnp.float32) @ w_deq
    np.testing.assert_allclose(np.asarray(grad, np.float32), ref, rtol=1e-2, atol=1e-2 * float(jnp.abs(ref).max()))


def test_train_base_stacks_both_layouts_and_chooses_by_rows():
    stack = quantize(_rand(11, (2, N, 64), 0.05).astype(jnp.bfloat16), "nvfp4")
    params = {"base": {"layers": {"q_proj": {"w": stack}}, "embed": jnp.zeros((4, 64))}}
    out = fp8_train_base(params, min_rows=16)
    w = out["base"]["layers"]["q_proj"]["w"]
    assert isinstance(w, ByRows) and w.max_rows == 15 and w.small is stack
    assert w.large.w_NxK.shape == (2, N, 64) and w.large.wt_KxN.shape == (2, 64, N)
    assert fp8.train_copy_bytes(params) == 2 * (2 * N * 64 + 4 * N + 4 * 64)
    layer = LayerOf(w, jnp.int32(1))  # as the model's layer scan sees it: ByRows of one layer
    one = jax.tree.map(lambda a: a[1], w)
    x_small, x_large = _rand(12, (15, 64)), _rand(13, (16, 64))
    # below min_rows: exactly the packed weight's path (the "off" numerics)
    np.testing.assert_array_equal(linear(x_small, one), linear(x_small, jax.tree.map(lambda a: a[1], stack)))
    ref = fp8.reference_matmul(x_large, fp8.from_dense(dequantize(jax.tree.map(lambda a: a[1], stack))))
    np.testing.assert_allclose(base_matmul(x_large, one), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(base_matmul(x_large, LayerOf(w.large, jnp.int32(1))), ref, rtol=1e-5, atol=1e-6)
    del layer


@pytest.mark.parametrize(
    "mode,quantized,device,expected",
    [("auto", True, True, True), ("auto", True, False, False), ("auto", False, True, False),
     ("on", False, False, True), ("off", True, True, False)],
)  # fmt: skip
def test_enabled(mode, quantized, device, expected):
    assert fp8.enabled(mode, quantized, device) is expected


def test_auto_is_off_on_the_cpu():
    assert not fp8.available() and not fp8.enabled("auto", True)


def test_rollout_fp8_copies_sample_what_the_fp8_forward_computes(tiny_qwen2_dir, monkeypatch):
    """fp8_matmul="on" (here from 1 row): the rollout's dense layer weights get E4M3 copies beside
    them (q/k/v and gate/up fused, the adapters' A outside FP8), its log-probs are those of one full
    forward through the FP8 base (`linear.fp8_train_base`) more closely than those of the bf16 path."""
    import qerl_jax
    from rollout_helpers import prompts, random_lora, recomputed_logp

    from qerl_jax.linear import Fused
    from qerl_jax.rollout import RolloutOptions, SamplingConfig, generate
    from qerl_jax.rollout import weights as weights_module

    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    params = {**params, "lora": random_lora(config)}
    split = weights_module.split_layers(params, "xla", fp8_min_rows=4)
    layer = split["layers"][1]["base"]
    qkv = layer["q_proj+k_proj+v_proj"]["w"]
    assert isinstance(qkv, ByRows) and qkv.max_rows == 3 and isinstance(qkv.large, Fused)
    assert qkv.large.lora_rows == 0 and fp8.is_fp8(qkv.large.w) and qkv.large.w.shape[0] == sum(qkv.large.sizes)
    made = sum(
        x.nbytes
        for lay in split["layers"]
        for p in lay["base"].values()
        if isinstance(p.get("w"), ByRows)
        for x in jax.tree.leaves(p["w"].large)
    )
    assert weights_module.fp8_copy_bytes(params, weights_module.packed_names(params)) == made
    monkeypatch.setattr(fp8, "MIN_ROWS", 1)
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, eos_ids=())
    opts = RolloutOptions(backend="xla", dense_weights=True, fp8_matmul="on", cache_dtype=jnp.float32)
    batch = generate(config, params, ids, mask, jax.random.key(3), sampling, group_size=2, options=opts)
    on_fp8, old, resp = recomputed_logp(config, fp8_train_base(params, min_rows=1), batch, 1.0)
    on_bf16, _, _ = recomputed_logp(config, params, batch, 1.0)
    gap_fp8 = np.abs(old - on_fp8)[resp == 1]
    gap_bf16 = np.abs(old - on_bf16)[resp == 1]
    # (this tiny model's near-uniform outputs: 0.0026 mean against 0.0036 from the bf16 forward)
    assert gap_fp8.max() < 0.05, gap_fp8.max()
    assert gap_fp8.mean() < 0.8 * gap_bf16.mean(), (gap_fp8.mean(), gap_bf16.mean())


def test_train_loss_and_gradients_on_fp8_copies_stay_near_the_bf16_path(tiny_qwen2_dir):
    """A token log-prob loss of the LoRA policy and its LoRA gradients: with the FP8 base from 1 row
    near the bf16-activation path's (E4M3 rounding moves them less than the 4-bit base itself does),
    and exactly it below the FP8 rows."""
    import qerl_jax
    from rollout_helpers import random_lora

    from qerl_jax.lora import with_lora

    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    lora = jax.tree.map(lambda a: a.astype(jnp.float32), random_lora(config))
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, config.vocab_size)

    def loss(lora_, base):
        logits = qerl_jax.forward(config, with_lora(base, lora_), ids)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    ref_loss, ref_grad = value_and_grad(lora, params)
    fp8_loss, fp8_grad = value_and_grad(lora, fp8_train_base(params, min_rows=1))
    off_loss, off_grad = value_and_grad(lora, fp8_train_base(params, min_rows=10**6))
    assert float(off_loss) == float(ref_loss)
    jax.tree.map(np.testing.assert_array_equal, off_grad, ref_grad)
    assert 0 < abs(float(fp8_loss) - float(ref_loss)) < 0.02 * abs(float(ref_loss))
    flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)])  # noqa: E731
    off_by = lambda g: float(jnp.linalg.norm(flat(g) - flat(ref_grad)) / jnp.linalg.norm(flat(ref_grad)))  # noqa: E731
    # the scale to judge it by: the 4-bit base's own effect, the float32 dense base's gradients
    # against NVFP4's (this tiny model: 0.18 against 0.30; q/k's adapters move most)
    _, dense_params = qerl_jax.load_model(path, dtype="float32", quant="bf16")
    _, dense_grad = value_and_grad(lora, dense_params)
    assert 0 < off_by(fp8_grad) < 0.75 * off_by(dense_grad), (off_by(fp8_grad), off_by(dense_grad))


def test_memory_plan_counts_the_train_fp8_copies():
    from qerl_jax import memory
    from qerl_jax.models.qwen2 import projection_shapes

    from benchmarks.common import model_config

    config = model_config("1.5B")
    off = memory.plan_memory(config, memory.PlanInputs())
    on = memory.plan_memory(config, memory.PlanInputs(fp8_copies=True))
    expected = sum(
        config.num_hidden_layers * (2 * n * k + 4 * (n + k)) for n, k in projection_shapes(config).values()
    )
    assert off.fp8_copies == 0 and on.fp8_copies == expected
    assert on.persistent - off.persistent == expected and on.total - off.total == expected
    assert "FP8 copies" in on.table()
