"""The packed 4-bit weight pytree shared by the quantizers, the kernels and the model.

Every quantized linear weight W [N, K] (N = output features, K = input features, the
PyTorch/HF layout) is stored as a `PackedWeight`:

- ``codes``: uint8 [..., N, K // 2]. Two 4-bit codes per byte along K: the low nibble
  holds element k = 2j, the high nibble element k = 2j + 1 (compressed-tensors' order).
- ``scales``: [..., N, K // block_size], one scale per block of ``block_size``
  consecutive elements along K:
    * "nvfp4": float8_e4m3fn, block 16;
    * "mxfp4": uint8 holding an E8M0 exponent e (scale = 2 ** (e - 127)), block 32;
    * "nf4":   float32 absmax of the block, block 64.
- ``global_scale``: float32 [...] (a scalar per matrix). For "nvfp4" it is
  compressed-tensors' ``weight_global_scale`` (448 * 6 / amax(W)), a *divisor*; for the
  other formats it is 1.

Decoding, for every format:  W[n, k] = table[code[n, k]] * scale[n, k // block] / global_scale
with ``table`` the format's 16-entry code table (`CODE_TABLES`). Leading "..." axes appear
when layers are stacked for `lax.scan` ([L, N, K // 2] etc.).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FORMATS = ("nvfp4", "mxfp4", "nf4")

BLOCK_SIZES = {"nvfp4": 16, "mxfp4": 32, "nf4": 64}

# E2M1: bit 3 is the sign, bits 0..2 index the magnitude.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

# The 16 NormalFloat levels of QLoRA (bitsandbytes' NF4 table), in code order.
NF4_VALUES = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)

CODE_TABLES = {"nvfp4": E2M1_VALUES, "mxfp4": E2M1_VALUES, "nf4": NF4_VALUES}


@struct.dataclass
class PackedWeight:
    """A 4-bit quantized linear weight of logical shape [..., N, K]; see module docstring."""

    codes: jax.Array  # uint8 [..., N, K // 2]
    scales: jax.Array  # [..., N, K // block_size]
    global_scale: jax.Array  # float32 [...]
    fmt: str = struct.field(pytree_node=False)

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.fmt]

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape [..., N, K]."""
        *lead, n, half_k = self.codes.shape
        return (*lead, n, 2 * half_k)

    @property
    def nbytes(self) -> int:
        return sum(
            int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in (self.codes, self.scales, self.global_scale)
        )


def is_packed(w) -> bool:
    return isinstance(w, PackedWeight)


def unpack_codes(codes: jax.Array) -> jax.Array:
    """uint8 [..., N, K // 2] -> uint8 codes [..., N, K] (low nibble first)."""
    low = codes & 0x0F
    high = codes >> 4
    return jnp.stack([low, high], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., N, K] in [0, 16) -> uint8 [..., N, K // 2] (low nibble first)."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


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


def e8m0_to_f32(e: jax.Array) -> jax.Array:
    """uint8 E8M0 exponents e -> float32 2 ** (e - 127), exactly.

    Built from the exponent bits (`jnp.exp2` is not exact on integers). e = 0 gives the
    subnormal 2 ** -127 (flushed to 0 on backends that flush denormals), e = 255 gives inf
    (OCP MX reserves it for NaN; compressed-tensors decodes it as 2 ** 128 = inf).
    """
    e = e.astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(e << 23, jnp.float32)
    return jnp.where(e == 0, jnp.float32(2.0**-127), normal)


def block_scales_f32(packed: PackedWeight) -> jax.Array:
    """The per-block multiplier as float32 [..., N, K // block], global scale folded in."""
    if packed.fmt == "nvfp4":
        s = packed.scales.astype(jnp.float32)
    elif packed.fmt == "mxfp4":
        s = e8m0_to_f32(packed.scales)
    elif packed.fmt == "nf4":
        s = packed.scales.astype(jnp.float32)
    else:
        raise ValueError(f"unknown packed format {packed.fmt!r}; expected one of {FORMATS}")
    return exact_div(s, packed.global_scale.astype(jnp.float32)[..., None, None])


def dequantize(packed: PackedWeight, dtype=jnp.float32) -> jax.Array:
    """PackedWeight -> dense [..., N, K] array of `dtype` (pure jnp, jit-able)."""
    table = jnp.asarray(CODE_TABLES[packed.fmt])
    values = table[unpack_codes(packed.codes).astype(jnp.int32)]
    *lead, n, k = values.shape
    blocks = values.reshape(*lead, n, k // packed.block_size, packed.block_size)
    out = blocks * block_scales_f32(packed)[..., None]
    return out.reshape(*lead, n, k).astype(dtype)


def replace(packed: PackedWeight, **kw) -> PackedWeight:
    return dataclasses.replace(packed, **kw)
