"""Correctly rounded float32 division, the same on CPU and GPU.

Shared by the quantizers (`qerl_jax.quant`) and the kernels' jnp fallbacks, which must round
exactly as the quantizers do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _div_rn_integer(num: jax.Array, den: jax.Array) -> jax.Array:
    """IEEE round-to-nearest-even num / den by integer long division of the mantissas.

    For finite num and positive normal den (a denormal num counts as zero and a denormal
    quotient is flushed to zero, as XLA on CPU does). Used where XLA's float division is
    not correctly rounded (GPU: PTX div.full.f32, up to 2 ulp off).
    """
    u32 = jnp.uint32
    ua = jax.lax.bitcast_convert_type(num, u32)
    ub = jax.lax.bitcast_convert_type(den, u32)
    sign = ua & u32(0x80000000)
    ea = ((ua >> 23) & u32(0xFF)).astype(jnp.int32)
    eb = ((ub >> 23) & u32(0xFF)).astype(jnp.int32)
    ma = (ua & u32(0x7FFFFF)) | u32(0x800000)
    mb = (ub & u32(0x7FFFFF)) | u32(0x800000)
    shift = ma < mb  # normalize so that ma / mb is in [1, 2)
    ma = jnp.where(shift, ma << 1, ma)
    exponent = ea - eb + 127 - shift.astype(jnp.int32)
    # 25 quotient bits (24 of mantissa + a guard bit); the remainder gives the sticky bit.
    rem, quo = ma, jnp.zeros_like(ma)
    for _ in range(25):
        bit = rem >= mb
        rem = jnp.where(bit, rem - mb, rem) << 1
        quo = (quo << 1) | bit.astype(u32)
    guard, mant = quo & u32(1), quo >> 1
    mant = mant + (guard & ((rem != 0).astype(u32) | (mant & u32(1))))
    carry = mant >> 24  # rounding overflowed to 2.0
    mant, exponent = mant >> carry, exponent + carry.astype(jnp.int32)
    bits = sign | (jnp.clip(exponent, 0, 255).astype(u32) << 23) | (mant & u32(0x7FFFFF))
    out = jax.lax.bitcast_convert_type(bits, jnp.float32)
    out = jnp.where(exponent >= 255, jax.lax.bitcast_convert_type(sign | u32(0x7F800000), jnp.float32), out)
    out = jnp.where((exponent <= 0) | (ea == 0), jax.lax.bitcast_convert_type(sign, jnp.float32), out)
    return jnp.where(eb == 0, num / den, out)  # den zero/denormal: outside the domain


def _div_native(num: jax.Array, den: jax.Array) -> jax.Array:
    # XLA rewrites `x / broadcast(d)` (and division by a constant) into `x * (1 / d)`, which
    # is off by an ulp for some values; the optimization barrier hides `den` from it.
    return num / jax.lax.optimization_barrier(den)


def exact_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """float32 num / den correctly rounded (IEEE, ties to even), broadcasting both.

    den must be positive and normal. XLA's own division is correctly rounded on CPU (once
    shielded from the reciprocal rewrite) but not on GPU, where an integer long division is
    used instead. Quotients in the denormal range are flushed to zero.
    """
    num, den = jnp.broadcast_arrays(jnp.asarray(num, jnp.float32), jnp.asarray(den, jnp.float32))
    return jax.lax.platform_dependent(num, den, cpu=_div_native, default=_div_rn_integer)
