"""NF4 weight quantization (QLoRA's 4-bit NormalFloat), blocks of 64 with an absmax scale.

code[n, k] = the NF4 level nearest to W[n, k] / absmax(block), found with the 15 midpoints
between neighbouring levels (a value exactly on a midpoint goes to the lower level);
scale = absmax(block) in float32, global scale 1. All-zero blocks get scale 0 and code 7
(the level 0.0). Double quantization of the absmax values (QLoRA's second stage) is not
implemented: the scales stay float32 (0.5 bit per weight of overhead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.numerics import exact_div
from qerl_jax.quant.formats import NF4, NF4_VALUES
from qerl_jax.quant.packed import PackedWeight, pack_codes

BLOCK = NF4.block_size
# NF4_VALUES is sorted ascending, so the code of a value is the number of midpoints below it.
NF4_MIDPOINTS = ((NF4_VALUES[1:] + NF4_VALUES[:-1]) / 2).astype(np.float32)


def nf4_codes(x_normalized: jax.Array) -> jax.Array:
    """float32 values in [-1, 1] -> uint8 NF4 codes of the nearest level."""
    mids = jnp.asarray(NF4_MIDPOINTS)
    return jnp.sum(x_normalized[..., None] > mids, axis=-1).astype(jnp.uint8)


def quantize_nf4(w: jax.Array) -> PackedWeight:
    """W [..., N, K] (float) -> NF4 PackedWeight; K must be a multiple of 64."""
    *lead, n, k = w.shape
    xb = w.astype(jnp.float32).reshape(*lead, n, k // BLOCK, BLOCK)
    absmax = jnp.max(jnp.abs(xb), axis=-1)
    safe = jnp.where(absmax > 0, absmax, 1.0)
    codes = nf4_codes(exact_div(xb, safe[..., None])).reshape(*lead, n, k)
    return PackedWeight(
        codes=pack_codes(codes),
        scales=absmax,
        global_scale=jnp.ones(tuple(lead), jnp.float32),
        fmt="nf4",
    )
