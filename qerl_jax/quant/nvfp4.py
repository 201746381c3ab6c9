"""NVFP4 weight quantization, bit-exact with compressed-tensors' "nvfp4-pack-quantized".

A weight W [..., N, K] is cut into blocks of 16 along K. Per matrix:

  global_scale = 448 * 6 / amax(W)                      (float32, a *divisor*)
  scale[n, g]  = fp8_e4m3(global_scale * amax(block) / 6) (0 -> 0.125)
  code[n, k]   = e2m1(clamp(W[n, k] / (scale / global_scale), -6, 6))

and the arithmetic follows the reference (llm-compressor's memoryless min-max observer
feeding compressed-tensors' `generate_gparam` / `calculate_qparams`, then the CPU path of
`NVFP4PackedCompressor.compress`) operation by operation:

* the observer statistics are computed in the weight's dtype: for bfloat16 weights
  `448 * 6 / amax` is torch's `reciprocal(amax) * 2688` with both steps rounded to bfloat16,
  and `amax(block) / 6` is rounded to bfloat16 before the float32 product with the global
  scale. The roundings are done with integer bit operations and the divisions with
  `exact_div` (correctly rounded on CPU and GPU), so XLA can neither elide a rounding nor
  approximate a division.
  Float32 weights use float32 throughout. Other float dtypes (float16, float64) are
  quantized from their float32 values (compressed-tensors would compute float16
  statistics in float16, whose range overflows the global scale for amax < 0.041);
* a global scale that overflows to inf (amax below ~8e-36, or all-zero) becomes 1.0;
* E2M1 rounding is round-half-to-even, and a negative value that rounds to zero keeps its
  sign bit (code 8), while -0.0 gets code 0 (as torch.sign(-0.0) == 0).

Known limit: JAX on CPU flushes float32 denormals to zero and torch does not, so tensors
whose amax is below ~1e-30 (where scale / global_scale becomes denormal) can differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import exact_div
from qerl_jax.quant.formats import NVFP4
from qerl_jax.quant.packed import PackedWeight, pack_codes

BLOCK = NVFP4.block_size
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# calculate_qparams replaces zero scales with the fp8 "eps" of compressed-tensors.
ZERO_SCALE_REPLACEMENT = 0.125
_F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # == finfo(bfloat16).tiny


def round_to_bf16(x: jax.Array) -> jax.Array:
    """float32 -> nearest bfloat16 value (ties to even), still float32; inf on overflow."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))
    return jax.lax.bitcast_convert_type(u & jnp.uint32(0xFFFF0000), jnp.float32)


def round_to_e4m3(x: jax.Array) -> jax.Array:
    """float32 in [-448, 448] -> nearest float8_e4m3fn value (ties to even), as float32.

    The quantum of the E4M3 grid at x is 2 ** (max(exponent(x), -6) - 3); scaling by its
    inverse, rounding half-to-even and scaling back is exact in float32.
    """
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    exponent = ((u >> 23) & jnp.uint32(0xFF)).astype(jnp.int32) - 127
    q_exp = jnp.maximum(exponent, -6) - 3
    pow2 = lambda e: jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.uint32), jnp.float32)  # noqa: E731
    return jnp.round(x * pow2(-q_exp)) * pow2(q_exp)


def e2m1_codes(q: jax.Array) -> jax.Array:
    """float32 values already clamped to [-6, 6] -> uint8 E2M1 codes (bit 3 = sign).

    Round half to even onto {0, .5, 1, 1.5, 2, 3, 4, 6}: the thresholds are the midpoints,
    with ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) going to the even neighbour.
    """
    a = jnp.abs(q)
    idx = (
        (a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    ).astype(jnp.uint8)
    return idx | ((q < 0).astype(jnp.uint8) << 3)


def _stat_round(dtype):
    """The rounding the reference applies to observer arithmetic for weights of `dtype`."""
    return round_to_bf16 if jnp.dtype(dtype) == jnp.bfloat16 else (lambda x: x)


def global_scale_from_amax(amax: jax.Array, dtype=jnp.float32) -> jax.Array:
    """compressed-tensors' `generate_gparam`: 448 * 6 / amax, float32 [...].

    `amax` (float32, >= 0) is the absolute max of a matrix (or of fused shards); `dtype` is
    the weight dtype the statistics are computed in (see module docstring).
    """
    rnd = _stat_round(dtype)
    amax = jnp.maximum(amax.astype(jnp.float32), _F32_TINY)
    gs = rnd(rnd(exact_div(jnp.float32(1.0), amax)) * (E4M3_MAX * E2M1_MAX))
    return jnp.where(jnp.isfinite(gs), gs, 1.0)


def block_scales(x_blocks: jax.Array, global_scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """compressed-tensors' `calculate_qparams` for NVFP4: float32 fp8-valued [..., N, G].

    x_blocks: float32 [..., N, G, 16]; global_scale: float32 [...].
    """
    rnd = _stat_round(dtype)
    bmax = jnp.max(jnp.abs(x_blocks), axis=-1)
    s = global_scale[..., None, None] * rnd(exact_div(bmax, jnp.float32(E2M1_MAX)))
    s = round_to_e4m3(jnp.clip(s, -E4M3_MAX, E4M3_MAX))
    return jnp.where(s == 0, jnp.float32(ZERO_SCALE_REPLACEMENT), s)


def quantize_nvfp4(w: jax.Array, *, amax: jax.Array | None = None) -> PackedWeight:
    """W [..., N, K] (float) -> NVFP4 PackedWeight; K must be a multiple of 16.

    amax: optional float32 [...] absolute max to derive the global scale from instead of
      amax(W); pass the max over fused shards (q/k/v, gate/up) so that they share one
      global scale, which vLLM requires.
    """
    *lead, n, k = w.shape
    x = w.astype(jnp.float32)
    if amax is None:
        amax = jnp.max(jnp.abs(x), axis=(-2, -1))
    gs = global_scale_from_amax(jnp.asarray(amax, jnp.float32), w.dtype)
    xb = x.reshape(*lead, n, k // BLOCK, BLOCK)
    scale = block_scales(xb, gs, w.dtype)
    divisor = exact_div(scale, gs[..., None, None])
    q = jnp.clip(exact_div(xb, divisor[..., None]), -E2M1_MAX, E2M1_MAX)
    codes = e2m1_codes(q).reshape(*lead, n, k)
    return PackedWeight(
        codes=pack_codes(codes),
        scales=scale.astype(jnp.float8_e4m3fn),
        global_scale=gs,
        fmt="nvfp4",
    )
