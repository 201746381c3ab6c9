"""The Mosaic GPU wgmma NVFP4 kernel's CPU-checkable parts: repacking and the register decode.

The kernel itself needs a Hopper GPU (Mosaic GPU has no CPU lowering); benchmarks/wgmma_probe.py
checks it there. Here: the load-time repack is exact and invertible, the scale re-encoding is
exact for every E4M3 value, and a numpy emulation of the kernel's PTX decode, placed by the
wgmma A-operand register layout, reproduces the dequantized weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import wgmma_nvfp4 as wn
from qerl_jax.quant import quantize
from qerl_jax.quant.packed import CODE_TABLES


def _dequant_np(p):
    codes = np.asarray(p.codes)
    scales = np.asarray(p.scales.astype(jnp.float32))
    nib = np.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], -1)
    return np.asarray(CODE_TABLES["nvfp4"], np.float32)[nib] * np.repeat(scales, 16, axis=1)


def _weights(n, k, seed=0):
    w = jax.random.normal(jax.random.key(seed), (n, k), jnp.float32)
    w = w.at[:, :16].set(0.0)  # an all-zero block column: zero scales
    w = w.at[3, 16:32].set(1e-6 * w[3, 16:32])  # tiny block next to large ones: E4M3-subnormal scale
    return quantize(w, "nvfp4")


@pytest.mark.parametrize("n,k", [(64, 64), (128, 256), (192, 448)])
def test_repack_round_trip(n, k):
    p = _weights(n, k)
    words, swords = wn.repack(p.codes, p.scales)
    assert words.shape == (n // 64, k // 64, 128, 4) and words.dtype == jnp.uint32
    assert swords.shape == (n // 64, k // 64, 64) and swords.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(wn.dequantize_repacked(words, swords)), _dequant_np(p))


def test_scale_encoding_exact_for_every_e4m3():
    e4m3 = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
    f = np.asarray(e4m3.astype(jnp.float32))
    ok = np.isfinite(f) & (f > 0)
    assert ok.sum() == 126  # 7 subnormals + 119 normals
    np.testing.assert_array_equal(np.asarray(wn.decode_scales(wn.encode_scales(e4m3)))[ok], f[ok])
    assert int(wn.encode_scales(jnp.zeros((), jnp.float8_e4m3fn))) == 0


def test_repack_rejects_unaligned_shapes():
    p = quantize(jnp.ones((96, 64), jnp.float32), "nvfp4")
    with pytest.raises(ValueError, match="N=96"):
        wn.repack(p.codes, p.scales)


def _bf16_bits_to_f32(bits16):
    return (bits16.astype(np.uint32) << 16).view(np.float32)


def _bf16_round(x):
    b = x.astype(np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # round to nearest even
    return _bf16_bits_to_f32(b.astype(np.uint16))


def emulate_decode(words, swords):
    """numpy twin of the kernel's PTX: float32 [N, K] = decoded bf16 W (value x 2**-8)."""
    words = np.asarray(words).astype(np.uint32)
    swords = np.asarray(swords).astype(np.uint32)  # [nt, kt, 64 rows]
    nt, kt = words.shape[:2]
    out = np.zeros((nt, kt, 64, 64), np.float32)
    for t in range(128):
        warp, lane = divmod(t, 32)
        for b in range(4):
            w = words[:, :, t, b]
            sreg = []
            for h in range(2):  # prmt (byte into both halves) + mad.lo (x16 + exponent offset)
                byte = (swords[:, :, 16 * warp + 8 * h + lane // 4] >> (8 * b)) & 0xFF
                sreg.append((byte * 16 + (wn._SCALE_BF16_ADD)).astype(np.uint16))
            for i in range(4):
                tt = (w << np.uint32(4 * (3 - i))) & np.uint32(0xFFFFFFFF)
                u = (tt & 0x80008000) | ((tt & 0x70007000) >> 6)
                for v in range(2):  # the two bf16 lanes of the register, times the scale (bf16x2 mul)
                    half = ((u >> (16 * v)) & 0xFFFF).astype(np.uint16)
                    val = _bf16_round(_bf16_bits_to_f32(half) * _bf16_bits_to_f32(sreg[i % 2]))
                    row = 16 * warp + 8 * (i % 2) + lane // 4
                    col = 16 * b + 8 * (i // 2) + 2 * (lane % 4) + v
                    out[:, :, row, col] = val
    return out.transpose(0, 2, 1, 3).reshape(nt * 64, kt * 64)


def test_emulated_register_decode_matches_dequantization():
    p = _weights(128, 192, seed=3)
    words, swords = wn.repack(p.codes, p.scales)
    got = emulate_decode(words, swords) * wn.OUT_FACTOR
    want = _dequant_np(p)
    # values are code x scale, exact in bf16 (2-bit x 4-bit mantissas) unless the product is tiny
    np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 2.0**-20)
    np.testing.assert_array_equal(got[np.abs(want) > 2.0**-100], want[np.abs(want) > 2.0**-100])


def test_wgmma_weight_matmul_equals_the_packed_weight_on_the_xla_path():
    """Off Hopper (and for M > MAX_ROWS) a WgmmaWeight is dequantized and multiplied: the same
    values as the PackedWeight it was made from, through the model's linear function."""
    from qerl_jax.linear import base_matmul

    p = _weights(128, 192, seed=4)
    w = wn.from_packed(p)
    assert w.shape == (128, 192)
    x = jax.random.normal(jax.random.key(1), (5, 192), jnp.float32)
    np.testing.assert_array_equal(np.asarray(wn.dequantize_wgmma(w)), np.asarray(quantize_dequant(p)))
    np.testing.assert_array_equal(np.asarray(base_matmul(x, w)), np.asarray(base_matmul(x, p)))
    with pytest.raises(ValueError, match="K=100"):
        wn.wgmma_linear(jnp.ones((2, 100)), w)


def quantize_dequant(p):
    from qerl_jax.quant.packed import dequantize

    return dequantize(p, jnp.float32)


def test_from_packed_rejects_other_formats_and_stacks():
    w = jnp.ones((64, 64), jnp.float32)
    assert wn.supports(quantize(w, "nvfp4")) and not wn.supports(quantize(w, "mxfp4"))
    with pytest.raises(ValueError, match="fmt='nf4'"):
        wn.from_packed(quantize(w, "nf4"))
    with pytest.raises(ValueError, match=r"shape=\(2, 64, 64\)"):
        wn.from_packed(quantize(jnp.ones((2, 64, 64), jnp.float32), "nvfp4"))


@pytest.mark.parametrize(
    "m,n,k,want",
    [
        (16, 3584, 3584, dict(tk=128, splits=14, stages=6, wgs=2)),  # 28 x 14 = 392 CTAs
        (1, 18944, 3584, dict(tk=128, splits=2, stages=6, wgs=2)),  # 148 x 2 = 296
        (64, 5120, 27648, dict(tk=128, splits=8, stages=6, wgs=2)),  # 40 x 8 = 320; 186 KB of SMEM
        (64, 5120, 5120, dict(tk=128, splits=8, stages=6, wgs=2)),
        (8, 192, 448, dict(tk=64, splits=7, stages=6, wgs=1)),  # odd tiles: one warpgroup, 64-col steps
    ],
)
def test_kernel_config(m, n, k, want):
    cfg = wn.kernel_config(m, n, k)
    assert cfg == want
    assert wn.smem_bytes(max(8, -(-m // 8) * 8), cfg["tk"], cfg["wgs"], cfg["stages"]) <= wn.SMEM_BUDGET


def test_fit_stages_shrinks_the_ring_to_shared_memory():
    assert wn.smem_bytes(64, 256, 2, 4) > wn.SMEM_BUDGET >= wn.smem_bytes(64, 256, 2, 3)
    assert wn.fit_stages(64, 256, 2, 6) == 3 and wn.fit_stages(16, 128, 2, 6) == 6


def test_by_rows_picks_the_layout_by_row_count():
    from qerl_jax.linear import ByRows, base_matmul

    p = _weights(64, 128, seed=5)
    big = jnp.full((64, 128), 7.0, jnp.float32)  # a different weight, to see which one is used
    w = ByRows(wn.from_packed(p), big, max_rows=4)
    x = jax.random.normal(jax.random.key(2), (4, 128), jnp.float32)
    np.testing.assert_array_equal(np.asarray(base_matmul(x, w)), np.asarray(base_matmul(x, p)))
    x5 = jnp.ones((5, 128), jnp.float32)
    np.testing.assert_array_equal(np.asarray(base_matmul(x5, w)), np.full((5, 64), 7.0 * 128))
