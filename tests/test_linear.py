"""qerl_jax.linear: the fused projections equal the projections one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.linear import Fused, fused_linear, linear, matmul_nt, stack_loras
from qerl_jax.quant import quantize
from qerl_jax.quant.packed import dequantize


def _projection(key, n, k, rank=3):
    kw, kb, ka, kl = jax.random.split(key, 4)
    w = jax.random.normal(kw, (n, k), jnp.float32)
    bias = 0.1 * jax.random.normal(kb, (n,), jnp.float32)
    lora = {"a": jax.random.normal(ka, (rank, k)), "b": jax.random.normal(kl, (n, rank))}
    return w, bias, lora


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "nvfp4"])
def test_fused_linear_equals_one_linear_per_projection(packed):
    """q/k/v-like projections (one with no bias, one with no LoRA) through one fused matmul and
    their stacked adapters: each output equals `linear` on its own weight, bias and LoRA."""
    k, sizes = 64, (64, 32, 32)
    projs = [_projection(jax.random.key(i), n, k) for i, n in enumerate(sizes)]
    ws = [quantize(w, "nvfp4") if packed else w for w, _, _ in projs]
    biases = [projs[0][1], None, projs[2][1]]
    loras = [projs[0][2], projs[1][2], None]
    stacked = quantize(jnp.concatenate([w for w, _, _ in projs]), "nvfp4") if packed else jnp.concatenate(ws)
    if packed:  # one tensor scale for the stack: compare with the stack's rows, not the separate ones
        ends = np.cumsum(sizes)
        ws = [
            stacked.replace(codes=stacked.codes[e - n : e], scales=stacked.scales[e - n : e])
            for n, e in zip(sizes, ends)
        ]
    x = jax.random.normal(jax.random.key(9), (2, 3, k), jnp.float32)
    fused = Fused(stacked, sizes, max_rows=6)
    got = fused_linear(x, fused, biases=biases, lora=stack_loras(loras, sizes), lora_scale=0.5)
    for y, w, bias, lora in zip(got, ws, biases, loras, strict=True):
        want = linear(x, w, bias=bias, lora=lora, lora_scale=0.5)
        assert y.shape == want.shape
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_weight_holding_the_adapters_a_equals_the_separate_adapter(dtype):
    """`Fused.lora_rows`: the stacked A below the weight's rows, its product taken from the base
    matmul, gives what the separate adapter matmuls give (float32: to rounding; bf16: each
    output within a bf16 ulp; the order of float32 sums differs), also for one projection alone
    (o_proj, down_proj)."""
    k = 64
    for sizes in ((64, 32, 32), (48,)):
        projs = [_projection(jax.random.key(i), n, k) for i, n in enumerate(sizes)]
        biases = [b for _, b, _ in projs]
        stacked = stack_loras([lora for _, _, lora in projs], sizes)
        stacked = jax.tree.map(lambda a: a.astype(dtype), stacked)
        w = jnp.concatenate([w for w, _, _ in projs]).astype(dtype)
        x = jax.random.normal(jax.random.key(9), (2, 3, k), jnp.float32).astype(dtype)
        separate = fused_linear(x, Fused(w, sizes, max_rows=6), biases=biases, lora=stacked, lora_scale=0.5)
        rank = stacked["a"].shape[0]
        holding = Fused(jnp.concatenate([w, stacked["a"]]), sizes, max_rows=6, lora_rows=rank)
        got = fused_linear(x, holding, biases=biases, lora=stacked, lora_scale=0.5)
        for y, want in zip(got, separate, strict=True):
            assert y.shape == want.shape and y.dtype == want.dtype
            tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=2**-7, atol=2**-7)
            np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), **tol)
    with pytest.raises(ValueError, match="holds the A of a rank-4 stacked LoRA; got rank None"):
        fused_linear(x, Fused(jnp.ones((52, k)), (48,), max_rows=6, lora_rows=4), biases=[None])


def test_stack_loras_is_block_diagonal():
    """A's stacked, B's on the diagonal (a projection without an adapter gets zero rows)."""
    a0, b0 = jnp.full((2, 4), 1.0), jnp.full((3, 2), 2.0)
    a2, b2 = jnp.full((1, 4), 3.0), jnp.full((5, 1), 4.0)
    stacked = stack_loras([{"a": a0, "b": b0}, None, {"a": a2, "b": b2}], (3, 6, 5))
    np.testing.assert_array_equal(np.asarray(stacked["a"]), np.concatenate([a0, a2]))
    want_b = np.zeros((14, 3), np.float32)
    want_b[0:3, 0:2] = 2.0
    want_b[9:14, 2:3] = 4.0
    np.testing.assert_array_equal(np.asarray(stacked["b"]), want_b)
    assert stack_loras([None, None], (3, 4)) is None
    with pytest.raises(ValueError, match="2 projections need as many LoRA entries"):
        stack_loras([None], (3, 4))
    with pytest.raises(ValueError, match="LoRA 0 has B with 3 rows; its projection has 4"):
        stack_loras([{"a": a0, "b": b0}, None], (4, 4))


def test_fused_linear_rejects_more_rows_and_mismatched_lists():
    fused = Fused(jnp.ones((8, 4)), (4, 4), max_rows=2)
    with pytest.raises(ValueError, match="at most 2 rows"):
        fused_linear(jnp.ones((3, 4)), fused, biases=[None, None])
    with pytest.raises(ValueError, match="2 projections"):
        fused_linear(jnp.ones((2, 4)), fused, biases=[None])
    with pytest.raises(ValueError, match="stacked LoRA B has 5 rows"):
        fused_linear(jnp.ones((2, 4)), fused, biases=[None, None], lora={"a": jnp.ones((1, 4)), "b": jnp.ones((5, 1))})


def test_matmul_nt_gradients_are_float32_autodiff_in_float32():
    x = jax.random.normal(jax.random.key(0), (5, 16))
    w = jax.random.normal(jax.random.key(1), (7, 16))
    g = jax.random.normal(jax.random.key(2), (5, 7))
    ours = jax.vjp(matmul_nt, x, w)[1](g)
    plain = jax.vjp(lambda a, b: a @ b.T, x, w)[1](g)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_matmul_nt_backward_takes_bf16_products_for_bf16_inputs():
    """A bf16 x: the cotangent is rounded to bf16 and the gradients are bf16 x bf16 products with
    float32 accumulation (what a bf16 framework computes), close to the float64 gradients."""
    x = jax.random.normal(jax.random.key(0), (32, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (48, 64)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), (32, 48))
    y, vjp = jax.vjp(matmul_nt, x, w)
    assert y.dtype == jnp.float32
    dx, dw = vjp(g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    g16 = np.asarray(g.astype(jnp.bfloat16), np.float64)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(dx, np.float64), g16 @ w64, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float64), g16.T @ x64, rtol=1e-2, atol=1e-2)
    text = jax.jit(lambda a, b, c: jax.vjp(matmul_nt, a, b)[1](c)).lower(x, w, g).as_text()
    operand_types = [line.split(": (")[1].split(") ->")[0] for line in text.splitlines() if "dot_general" in line]
    assert len(operand_types) == 2, operand_types  # the two gradients (the forward product is unused)
    assert all(t.count("bf16") == 2 for t in operand_types), operand_types


def _bf16_ulps(got, want_f32) -> np.ndarray:
    """|got - want| in bf16 ulps of want rounded to bf16 (got bf16, want float32)."""
    want = np.asarray(jnp.asarray(want_f32).astype(jnp.bfloat16), np.float32)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
    return np.abs(np.asarray(got, np.float32) - want) / ulp


@pytest.mark.parametrize("m", [5, 300], ids=["kernel", "dequant"])
def test_packed_pallas_linear_rounds_once_like_the_dense_path(m):
    """bf16 x through an NVFP4 weight (the Pallas train path), + bias + LoRA: the float32 product
    plus bias and LoRA delta, rounded to bf16 once (the dense path's structure), within one bf16 ulp.
    The bias nearly cancels the product, so a product rounded to bf16 before the adds (twice
    rounded) would be off by many ulps of the small sum."""
    pallas_kernels = pytest.importorskip("pallas_kernels")
    n, k = 64, 128
    w, _, lora = _projection(jax.random.key(3), n, k)
    p = quantize(w, "nvfp4")
    x = jax.random.normal(jax.random.key(4), (m, k), jnp.float32).astype(jnp.bfloat16)
    lora = jax.tree.map(lambda a: (0.05 * a).astype(jnp.bfloat16), lora)
    # The kernel regime decodes exactly (E2M1 x E4M3 values are bf16 numbers) and divides the float32
    # product by the global scale; the dequant regime (M > 256) writes W / global scale in bf16 first.
    w_ref = dequantize(p, jnp.float32) if m <= 256 else pallas_kernels.dequantize_bf16(p).astype(jnp.float32)
    base = jnp.dot(x.astype(jnp.float32), w_ref.T, precision=jax.lax.Precision.HIGHEST)
    bias = -0.999 * base[0]  # row 0's product nearly cancelled
    h = jnp.dot(x.astype(jnp.float32), lora["a"].astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    delta = jnp.dot(
        (0.5 * h).astype(jnp.bfloat16).astype(jnp.float32),
        lora["b"].astype(jnp.float32).T,
        precision=jax.lax.Precision.HIGHEST,
    )
    want = base + bias + delta
    got = linear(x, p, bias=bias, lora=lora, lora_scale=0.5, backend="pallas")
    assert got.dtype == jnp.bfloat16
    assert _bf16_ulps(got, want).max() <= 1.0
    twice = base.astype(jnp.bfloat16).astype(jnp.float32) + bias + delta
    assert _bf16_ulps(twice.astype(jnp.bfloat16), want).max() > 4.0  # the check can fail
    w_bf16 = dequantize(p, jnp.bfloat16)  # the dense path's weight: rounded to bf16 after the global scale
    dense = linear(x, w_bf16, bias=bias, lora=lora, lora_scale=0.5)
    dense_base = jnp.dot(x.astype(jnp.float32), w_bf16.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    assert _bf16_ulps(dense, dense_base + bias + delta).max() <= 1.0
