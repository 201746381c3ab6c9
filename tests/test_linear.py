"""qerl_jax.linear: the fused projections equal the projections one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.linear import Fused, fused_linear, linear, stack_loras
from qerl_jax.quant import quantize


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
