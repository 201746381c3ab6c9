"""A packed 4-bit format as the kernels see it (`KernelFormat`), and its decode.

The kernels take the packed arrays plus this description; they know no format by name except
where a kernel is tuned for one (autotune entries, the NVFP4-only kernels). Scales are decoded
by their dtype: float8_e4m3fn (NVFP4), uint8 E8M0 exponents 2**(e-127) (MXFP4), float32 (NF4).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class KernelFormat(NamedTuple):
    """What the kernels need of a packed format (hashable: a static argument under jit)."""

    name: str  # keys the autotune table
    block_size: int  # elements along K per scale
    code_table: tuple[float, ...]  # the 16 code values
    scale_dtype: np.dtype  # float8_e4m3fn | uint8 (E8M0) | float32

    @classmethod
    def of(cls, fmt: Any) -> KernelFormat:
        """Any object with these four fields (e.g. `qerl_jax.quant.Format`) -> a KernelFormat."""
        if isinstance(fmt, cls):
            return fmt
        return cls(str(fmt.name), int(fmt.block_size), tuple(map(float, fmt.code_table)), np.dtype(fmt.scale_dtype))


def bf16_table(fmt: KernelFormat) -> list[float]:
    """The code table rounded to bf16 (what the kernel multiplies), as Python floats."""
    return [float(v) for v in np.asarray(fmt.code_table, np.float32).astype(jnp.bfloat16).astype(np.float32)]


def scales_to_bf16(s: jax.Array, fmt: KernelFormat) -> jax.Array:
    """A loaded scale tile -> bf16 block multipliers (global scale not applied).

    nvfp4 (e4m3) and mxfp4 (e8m0, 2**(e-127)) are exact in bf16; nf4's f32 absmax is
    rounded to bf16.
    """
    if fmt.scale_dtype == jnp.float8_e4m3fn and s.dtype == jnp.uint8:  # e4m3 scales loaded as raw bytes
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn)
    elif fmt.scale_dtype == jnp.uint8:
        bits = s.astype(jnp.int32) << 7  # exponent field of a bf16 with zero mantissa
        bits = jnp.where(s == 0, 0x40, bits)  # e = 0 is 2**-127, a bf16 subnormal
        return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)
    return s.astype(jnp.bfloat16)


def decode_jnp(codes: jax.Array, scale_bf16: jax.Array, fmt: KernelFormat) -> tuple[jax.Array, jax.Array]:
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
