"""MXFP4 weight quantization, bit-exact with compressed-tensors' "mxfp4-pack-quantized".

OCP Microscaling FP4: blocks of 32 along K, E2M1 elements, one E8M0 (power of two)
scale per block stored as its biased exponent e (scale = 2 ** (e - 127)). No global scale.

The block exponent follows compressed-tensors (`generate_mx_scales`), which differs from
the OCP spec's floor(log2(amax)) - 2 in one respect: amax is first rounded to a power of
two, upwards when its mantissa is >= 1.75, so a block max in [1.75, 2) * 2**m is scaled
to 3.5..4 instead of clipping at 6 from 7..8. Then

  e = clamp(127 + log2(pow2(amax)) - 2, 0, 255)   (all-zero blocks: e = 0)
  code = e2m1(clamp(W / 2 ** (e - 127), -6, 6))    (round half to even)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qerl_jax.quant.formats import MXFP4
from qerl_jax.quant.nvfp4 import E2M1_MAX, e2m1_codes
from qerl_jax.quant.packed import PackedWeight, pack_codes

BLOCK = MXFP4.block_size
_E2M1_EMAX = 2  # floor(log2(6))


def block_exponents(bmax: jax.Array) -> jax.Array:
    """float32 block absmax [...] -> uint8 E8M0 exponents [...] (compressed-tensors rule).

    The power-of-two rounding adds half an E2M1 mantissa step (bit 21 of the float32
    mantissa) and drops the mantissa; the same bits decide for bfloat16 inputs, whose
    values are float32 values with a shorter mantissa.
    """
    u = jax.lax.bitcast_convert_type(bmax.astype(jnp.float32), jnp.uint32) + jnp.uint32(1 << 21)
    field = ((u >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    e = jnp.where(field == 255, 255, field - _E2M1_EMAX)  # 255: pow2 overflowed to inf
    e = jnp.where(field == 0, 0, e)  # pow2 == 0: log2 = -inf, clamped to 0
    return jnp.clip(e, 0, 255).astype(jnp.uint8)


def _inv_pow2(e: jax.Array) -> jax.Array:
    """uint8 exponents -> float32 2 ** (127 - e), exact for e <= 253 (never denormal)."""
    field = jnp.clip(254 - e.astype(jnp.int32), 1, 254)
    return jax.lax.bitcast_convert_type((field << 23).astype(jnp.uint32), jnp.float32)


def quantize_mxfp4(w: jax.Array) -> PackedWeight:
    """W [..., N, K] (float) -> MXFP4 PackedWeight; K must be a multiple of 32."""
    *lead, n, k = w.shape
    xb = w.astype(jnp.float32).reshape(*lead, n, k // BLOCK, BLOCK)
    e = block_exponents(jnp.max(jnp.abs(xb), axis=-1))
    # Dividing by 2 ** (e - 127) is multiplying by 2 ** (127 - e): exact either way, but the
    # multiplier stays a normal float where the divisor could be a flushed denormal.
    q = jnp.clip(xb * _inv_pow2(e)[..., None], -E2M1_MAX, E2M1_MAX)
    codes = e2m1_codes(q).reshape(*lead, n, k)
    return PackedWeight(
        codes=pack_codes(codes),
        scales=e,
        global_scale=jnp.ones(tuple(lead), jnp.float32),
        fmt="mxfp4",
    )
