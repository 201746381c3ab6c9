"""The three packed 4-bit formats as the kernels see them: code table, block, scale decode.

The code tables and block sizes are `qerl_jax.quant.packed`'s (the one definition of the
formats); this module adds what only the kernels need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant.packed import BLOCK_SIZES, CODE_TABLES, FORMATS  # noqa: F401 (re-exported)

SCALE_DTYPES = {"nvfp4": jnp.dtype(jnp.float8_e4m3fn), "mxfp4": jnp.dtype(jnp.uint8), "nf4": jnp.dtype(jnp.float32)}


def bf16_table(fmt: str) -> list[float]:
    """The code table rounded to bf16 (what the kernel multiplies), as Python floats."""
    return [float(v) for v in np.asarray(CODE_TABLES[fmt]).astype(jnp.bfloat16).astype(np.float32)]


def scales_to_bf16(s: jax.Array, fmt: str) -> jax.Array:
    """A loaded scale tile -> bf16 block multipliers (global scale not applied).

    nvfp4 (e4m3) and mxfp4 (e8m0, 2**(e-127)) are exact in bf16; nf4's f32 absmax is
    rounded to bf16.
    """
    if fmt == "nvfp4" and s.dtype == jnp.uint8:  # the kernels load e4m3 scales as raw bytes
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn)
    if fmt == "mxfp4":
        bits = s.astype(jnp.int32) << 7  # exponent field of a bf16 with zero mantissa
        bits = jnp.where(s == 0, 0x40, bits)  # e = 0 is 2**-127, a bf16 subnormal
        return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)
    return s.astype(jnp.bfloat16)


def decode_jnp(codes: jax.Array, scale_bf16: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """uint8 codes [R, C] and bf16 scales [R, C] -> bf16 (even, odd) elements [R, C].

    Portable version of the PTX in `decode_asm` (interpret mode and the GPU fallback):
    the table lookup is a chain of selects, the product is rounded once to bf16.
    """
    table = bf16_table(fmt)

    def lookup(idx):
        out = jnp.zeros(idx.shape, jnp.float32)
        for i, v in enumerate(table):
            if v != 0.0:  # the zero entries (+0 and -0) are the initial value
                out = jnp.where(idx == i, v, out)
        return out

    s = scale_bf16.astype(jnp.float32)
    lo = (codes & 0x0F).astype(jnp.int32)
    hi = (codes >> 4).astype(jnp.int32)
    return (lookup(lo) * s).astype(jnp.bfloat16), (lookup(hi) * s).astype(jnp.bfloat16)
