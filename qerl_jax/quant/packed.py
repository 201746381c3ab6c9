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
with ``table`` the format's 16-entry code table (`formats.Format.code_table`). Leading "..." axes appear
when layers are stacked for `lax.scan` ([L, N, K // 2] etc.).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from pallas_kernels.numerics import exact_div
from qerl_jax.quant.formats import FORMATS, Format
from qerl_jax.quant.formats import get as get_format


@struct.dataclass
class PackedWeight:
    """A 4-bit quantized linear weight of logical shape [..., N, K]; see module docstring."""

    codes: jax.Array  # uint8 [..., N, K // 2]
    scales: jax.Array  # [..., N, K // block_size]
    global_scale: jax.Array  # float32 [...]
    fmt: str = struct.field(pytree_node=False)

    @property
    def format(self) -> Format:
        """The format's record (the description `pallas_kernels` takes)."""
        return get_format(self.fmt)

    @property
    def block_size(self) -> int:
        return self.format.block_size

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


def splits_over(n: int, k: int, dim: int, parts: int, block_size: int = 1) -> bool:
    """Whether a weight [N, K] splits evenly over `parts` devices along dim -2 (its output
    features) or -1 (its input features, in whole blocks of `block_size`: 1 for a dense weight).
    The one tensor-parallel rule: the sharding, the memory plan and the per-device kernels use it."""
    if dim == -2:
        return n % parts == 0
    return k % block_size == 0 and (k // block_size) % parts == 0


def split_specs(w: PackedWeight, dim: int | None, axis: str) -> PackedWeight:
    """The PartitionSpecs of a packed weight (or stack) split over mesh axis `axis` along its output
    (dim -2) or input (dim -1) features, codes and block scales together (dim None: replicated);
    the global scale replicated."""
    spec = [None] * w.codes.ndim
    if dim is not None:
        spec[dim] = axis
    return PackedWeight(codes=P(*spec), scales=P(*spec), global_scale=P(*((None,) * w.global_scale.ndim)), fmt=w.fmt)


def unpack_codes(codes: jax.Array) -> jax.Array:
    """uint8 [..., N, K // 2] -> uint8 codes [..., N, K] (low nibble first)."""
    low = codes & 0x0F
    high = codes >> 4
    return jnp.stack([low, high], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., N, K] in [0, 16) -> uint8 [..., N, K // 2] (low nibble first)."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


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
    table = jnp.asarray(packed.format.code_table, jnp.float32)
    values = table[unpack_codes(packed.codes).astype(jnp.int32)]
    *lead, n, k = values.shape
    blocks = values.reshape(*lead, n, k // packed.block_size, packed.block_size)
    out = blocks * block_scales_f32(packed)[..., None]
    return out.reshape(*lead, n, k).astype(dtype)


def replace(packed: PackedWeight, **kw) -> PackedWeight:
    return dataclasses.replace(packed, **kw)
