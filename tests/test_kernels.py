"""Pallas W4A16 kernels (pallas_kernels/) in interpret mode on CPU against the jnp reference.

Every check draws fresh random codes, scales, global scale and activations, NaN-fills the
kernel's output buffer first (so unwritten elements fail), and compares in float32 with
the relative Frobenius error. The PTX nibble decoder, which interpret mode cannot run, is
checked through its numpy model (`decode_asm.emulate`) for all 256 byte values.
"""

from __future__ import annotations

import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import autotune, decode_asm, formats
from pallas_kernels.quant_matmul import _dequantize, backward_launch, forward_launch
from qerl_jax.quant import packed as packed_lib
from qerl_jax.quant.formats import FORMATS, REGISTRY

TOL = 1e-2  # bf16 output (and bf16 NF4 table / scales) against float32


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rand_packed(rng: np.random.Generator, n: int, k: int, fmt: str) -> packed_lib.PackedWeight:
    """Random codes, random positive finite block scales, random global scale."""
    block = REGISTRY[fmt].block_size
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    if fmt == "nvfp4":
        scales = jnp.asarray(rng.uniform(2.0**-6, 448.0, (n, k // block)).astype(np.float32)).astype(jnp.float8_e4m3fn)
    elif fmt == "mxfp4":
        scales = jnp.asarray(rng.integers(112, 143, (n, k // block), dtype=np.uint8))
    else:
        scales = jnp.asarray(rng.uniform(0.01, 3.0, (n, k // block)).astype(np.float32))
    gs = jnp.float32(rng.uniform(20.0, 3000.0) if fmt == "nvfp4" else rng.uniform(0.5, 2.0))
    return packed_lib.PackedWeight(jnp.asarray(codes), scales, gs, fmt)


def rand_x(rng: np.random.Generator, m: int, k: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)).astype(jnp.bfloat16)


def reference(x: jax.Array, p: packed_lib.PackedWeight) -> jax.Array:
    w = packed_lib.dequantize(p, jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "output has NaN/inf: an element was not written"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _args(p):
    return p.codes, p.scales, p.global_scale


# ----------------------------------------------------------------------------- format pieces


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])  # mxfp4 shares nvfp4's table
def test_ptx_decoder_model_all_bytes(fmt):
    rng = _rng("ptx", fmt)
    table = np.asarray(REGISTRY[fmt].code_table, np.float32)
    codes = np.tile(np.arange(256, dtype=np.uint8), 4)
    scales = rng.uniform(2.0**-9, 448.0, codes.shape).astype(np.float32)
    scales[:8] = 0.0  # zero scale (masked rows) must give 0, not NaN
    sbits = decode_asm.bf16_bits(scales)
    even, odd = decode_asm.emulate(table, codes, sbits)
    t = decode_asm.bf16_to_f32(decode_asm.bf16_bits(table))
    s = decode_asm.bf16_to_f32(sbits)
    np.testing.assert_array_equal(
        decode_asm.bf16_to_f32(even), decode_asm.bf16_to_f32(decode_asm.bf16_bits(t[codes & 15] * s))
    )
    np.testing.assert_array_equal(
        decode_asm.bf16_to_f32(odd), decode_asm.bf16_to_f32(decode_asm.bf16_bits(t[codes >> 4] * s))
    )


def test_ptx_text_uses_only_modelled_instructions():
    for fmt in ("nvfp4", "nf4"):
        text = decode_asm.ptx(np.asarray(REGISTRY[fmt].code_table, np.float32))
        ops = {line.split()[0] for line in text.splitlines()[2:-1]}
        assert ops <= {"mov.b32", "and.b32", "shr.u32", "shl.b32", "prmt.b32", "lop3.b32", "fma.rn.bf16x2"}, ops
        assert text.count("$4") >= 1 and all(f"${i}" in text for i in range(9))


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_decode(fmt):
    p = rand_packed(_rng("scale", fmt), 8, 128, fmt)
    want = packed_lib.block_scales_f32(packed_lib.replace(p, global_scale=jnp.float32(1.0)))
    got = formats.scales_to_bf16(p.scales, formats.KernelFormat.of(REGISTRY[fmt])).astype(jnp.float32)
    rtol = 2.0**-8 if fmt == "nf4" else 0.0  # nf4's f32 absmax is rounded to bf16
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol)
    if fmt == "mxfp4":  # the e = 0 (2**-127, subnormal) and e = 255 (inf) ends
        ends = formats.scales_to_bf16(jnp.array([0, 1, 254, 255], jnp.uint8), formats.KernelFormat.of(REGISTRY[fmt])).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(ends), np.array([2.0**-127, 2.0**-126, 2.0**127, np.inf], np.float32))


# ----------------------------------------------------------------------------- forward

# (fmt, M, N, K): every format sees both regimes (M <= 64 decode, M = 130 prefill),
# non-power-of-two N and both K sizes.
FWD_CASES = [
    ("nvfp4", 1, 48, 64),
    ("nvfp4", 3, 200, 256),
    ("nvfp4", 16, 96, 256),
    ("nvfp4", 64, 200, 64),
    ("nvfp4", 130, 96, 256),
    ("mxfp4", 1, 200, 256),
    ("mxfp4", 16, 48, 64),
    ("mxfp4", 64, 96, 256),
    ("mxfp4", 130, 200, 64),
    ("nf4", 1, 96, 256),
    ("nf4", 3, 48, 64),
    ("nf4", 16, 200, 256),
    ("nf4", 130, 48, 256),
]


@pytest.mark.parametrize("fmt,m,n,k", FWD_CASES)
def test_forward_matches_reference(fmt, m, n, k):
    rng = _rng("fwd", fmt, m, n, k)
    p = rand_packed(rng, n, k, fmt)
    x = rand_x(rng, m, k)
    out = forward_launch(x, *_args(p), fmt=REGISTRY[fmt], interpret=True, poison=True)
    assert out.dtype == jnp.float32  # unrounded: the caller's epilogue rounds once
    assert rel_err(out, reference(x, p)) < TOL


@pytest.mark.parametrize(
    "cfg",
    [
        autotune.Config(bm=16, bn=32, bk=64, split_k=2),  # split-K partials + reduction
        autotune.Config(bm=16, bn=64, bk=128, swap=True),  # y.T = W @ x.T
        autotune.Config(bm=32, bn=32, bk=64, group_m=2),  # several M tiles, grouped order
        autotune.Config(bm=64, bn=64, bk=64, mode="dequant"),  # dequant kernel + XLA dot
        autotune.Config(bm=16, bn=64, bk=256, split_k=2, scale_words=True),  # scales as int32 words
    ],
    ids=["splitk", "swap", "grouped", "dequant", "scale_words"],
)
def test_forward_configs(cfg):
    rng = _rng("cfg", cfg)
    m, n, k = (20, 72, 256) if cfg.group_m != 2 else (100, 72, 128)
    p = rand_packed(rng, n, k, "nvfp4")
    x = rand_x(rng, m, k)
    out = forward_launch(x, *_args(p), fmt=REGISTRY["nvfp4"], interpret=True, cfg=cfg, poison=True)
    assert rel_err(out, reference(x, p)) < TOL


def test_bits_decode_formula_all_bytes():
    """The block kernel's GPU decode: for every code byte, the low / high 16 bits of
    decode_bits_pairs are bf16 patterns of table[nibble] * 2**-126, exactly (numpy keeps the
    subnormal 0.5 * 2**-126 that XLA on CPU would flush, which is why interpret mode uses the
    jnp decode)."""
    import ml_dtypes

    qm = importlib.import_module("pallas_kernels.quant_matmul")
    pairs = np.asarray(qm.decode_bits_pairs(jnp.arange(256, dtype=jnp.int32))).view(np.uint32)
    table = np.asarray(REGISTRY["nvfp4"].code_table, np.float64)
    for half, nibble in ((pairs & 0xFFFF, np.arange(256) & 0xF), (pairs >> 16, np.arange(256) >> 4)):
        got = half.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64) * 2.0**126
        np.testing.assert_array_equal(got, table[nibble])
        np.testing.assert_array_equal(np.signbit(got), nibble >= 8)  # -0 keeps its sign


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (5, 72, 256, autotune.Config(bm=16, bn=64, bk=64, split_k=2, mode="block")),  # ragged N, split-K
        (32, 48, 128, autotune.Config(bm=32, bn=16, bk=16, mode="block")),  # one block per step
        (1, 40, 512, autotune.Config(bm=16, bn=32, bk=128, split_k=4, num_stages=2, mode="block")),
        (7, 72, 256, autotune.Config(bm=16, bn=64, bk=64, split_k=2, swap=True, mode="block")),  # y.T = W @ x.T
        (50, 48, 128, autotune.Config(bm=64, bn=32, bk=64, mode="block")),  # M > 32: swap forced
        (130, 40, 128, autotune.Config(bm=16, bn=32, bk=64, mode="block", num_warps=8)),  # one 256-row M tile
    ],
    ids=["ragged_splitk", "bk16", "m1_split4", "swap", "m50_swap", "m130"],
)
def test_block_kernel_configs(m, n, k, cfg):
    rng = _rng("block", m, n, k)
    p = rand_packed(rng, n, k, "nvfp4")
    x = rand_x(rng, m, k)
    out = forward_launch(x, *_args(p), fmt=REGISTRY["nvfp4"], interpret=True, cfg=cfg, poison=True)
    assert out.shape == (m, n) and rel_err(out, reference(x, p)) < TOL


def test_block_mode_only_for_nvfp4_and_small_m():
    """A "block" config (table or given) falls back to the 2-D kernels where it does not
    apply: other formats and M > BLOCK_MAX_M (256)."""
    assert autotune.default_config("fwd", 16, 512, 512).mode == "block"
    assert autotune.default_config("fwd", 16, 512, 512, "mxfp4").mode == "fused"
    assert autotune.default_config("fwd", 64, 512, 512).swap
    assert autotune.default_config("fwd", 65, 512, 512).mode == "dequant"  # block only where measured faster
    rng = _rng("block_fallback")
    block = autotune.Config(bm=16, bn=64, bk=64, mode="block")
    for fmt, m in (("mxfp4", 3), ("nf4", 3), ("nvfp4", 300)):
        p = rand_packed(rng, 48, 128, fmt)
        x = rand_x(rng, m, 128)
        assert rel_err(forward_launch(x, *_args(p), fmt=REGISTRY[fmt], interpret=True, cfg=block), reference(x, p)) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel(fmt):
    rng = _rng("deq", fmt)
    p = rand_packed(rng, 40, 128, fmt)  # 40 rows: a ragged last tile
    w = _dequantize(*_args(p), fmt=REGISTRY[fmt], interpret=True)
    want = packed_lib.dequantize(p, jnp.float32)
    # nvfp4 / mxfp4: table * scale is exact in bf16, then one rounding after / global_scale;
    # nf4 also rounds its table entry, its absmax and the product to bf16.
    np.testing.assert_allclose(np.asarray(w, np.float32), np.asarray(want), rtol=2.0**-6 if fmt == "nf4" else 2.0**-8)


def test_public_dequantize_bf16_of_a_matrix_and_of_a_stacked_layer():
    rng = _rng("deq_public")
    layers = [rand_packed(rng, 40, 64, "nvfp4") for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    w = pallas_kernels.dequantize_bf16(layers[1])
    assert w.dtype == jnp.bfloat16 and w.shape == (40, 64)
    np.testing.assert_array_equal(
        np.asarray(w, np.float32), np.asarray(_dequantize(*_args(layers[1]), fmt=REGISTRY["nvfp4"], interpret=True), np.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(pallas_kernels.dequantize_bf16(stack, layer=jnp.int32(1)), np.float32), np.asarray(w, np.float32)
    )
    with pytest.raises(ValueError, match="out of range"):
        pallas_kernels.dequantize_bf16(stack, layer=3)


def test_public_api_and_nvfp4_alias():
    rng = _rng("api")
    p = rand_packed(rng, 48, 64, "nvfp4")
    x = rand_x(rng, 5, 64)
    ref = reference(x, p)
    assert rel_err(pallas_kernels.quant_matmul(x, p), ref) < TOL  # interpret=None -> CPU -> interpret
    assert rel_err(jax.jit(pallas_kernels.nvfp4_matmul)(x, p), ref) < TOL
    with pytest.raises(ValueError, match="nvfp4"):
        pallas_kernels.nvfp4_matmul(x, rand_packed(rng, 48, 64, "mxfp4"))


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("fmt,m,n,k", [("nvfp4", 1, 200, 64), ("mxfp4", 130, 48, 256), ("nf4", 16, 96, 128)])
def test_backward_kernel(fmt, m, n, k):
    rng = _rng("bwd", fmt, m, n, k)
    p = rand_packed(rng, n, k, fmt)
    dy = rand_x(rng, m, n)
    want = jnp.dot(dy.astype(jnp.float32), packed_lib.dequantize(p, jnp.float32), precision=jax.lax.Precision.HIGHEST)
    fused = autotune.Config(bm=64, bn=0, bk=64, bc=64)  # the default for M > 64 is "dequant"
    out = backward_launch(dy, *_args(p), fmt=REGISTRY[fmt], interpret=True, poison=True, cfg=fused)
    assert out.shape == (m, k) and out.dtype == jnp.bfloat16
    assert rel_err(out, want) < TOL
    out = backward_launch(dy, *_args(p), fmt=REGISTRY[fmt], interpret=True, cfg=autotune.Config(bm=64, bn=0, bk=64, mode="dequant"))
    assert rel_err(out, want) < TOL


@pytest.mark.parametrize("fmt,m", [("nvfp4", 3), ("nf4", 70)])
def test_grad_wrt_x_matches_reference(fmt, m):
    rng = _rng("grad", fmt, m)
    n, k = 48, 128
    p = rand_packed(rng, n, k, fmt)
    x = rand_x(rng, m, k)
    g = jnp.asarray(rng.standard_normal((m, n)).astype(np.float32))

    def loss(fn, x):
        return jnp.sum(fn(x).astype(jnp.float32) * g)

    got = jax.grad(lambda x: loss(lambda x: pallas_kernels.quant_matmul(x, p), x))(x)
    want = jax.grad(lambda x: loss(lambda x: reference(x, p), x))(x)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, want) < TOL


def test_weight_cotangents_are_zero():
    rng = _rng("wgrad")
    p = rand_packed(rng, 48, 64, "nvfp4")
    x = rand_x(rng, 4, 64)
    _, vjp = jax.vjp(lambda x, p: pallas_kernels.quant_matmul(x, p), x, p)
    dx, dp = vjp(jnp.ones((4, 48), jnp.float32))
    assert dp.codes.dtype == jax.dtypes.float0  # integer codes: float0
    assert not np.any(np.asarray(dp.scales, np.float32)) and not np.any(np.asarray(dp.global_scale))
    assert np.any(np.asarray(dx, np.float32))


# ----------------------------------------------------------------------------- bad input


def test_errors_before_launch():
    rng = _rng("err")
    p = rand_packed(rng, 48, 64, "nvfp4")
    x = rand_x(rng, 4, 64)
    qm = pallas_kernels.quant_matmul
    with pytest.raises(ValueError, match="2-D"):
        qm(x[0], p)
    with pytest.raises(ValueError, match="2-D"):
        qm(x[None], p)
    with pytest.raises(ValueError, match="K mismatch"):
        qm(rand_x(rng, 4, 32), p)
    with pytest.raises(TypeError, match="bfloat16"):
        qm(x.astype(jnp.float32), p)
    with pytest.raises(ValueError, match="block size"):
        bad = packed_lib.PackedWeight(
            jnp.zeros((48, 12), jnp.uint8), jnp.zeros((48, 1), jnp.float8_e4m3fn), jnp.float32(1), "nvfp4"
        )
        qm(rand_x(rng, 4, 24), bad)
    with pytest.raises(ValueError, match="scales must have shape"):
        qm(x, packed_lib.replace(p, scales=p.scales[:, :2]))
    with pytest.raises(TypeError, match="scales must be"):
        qm(x, packed_lib.replace(p, scales=p.scales.astype(jnp.float32)))
    with pytest.raises(TypeError, match="codes must be uint8"):
        qm(x, packed_lib.replace(p, codes=p.codes.astype(jnp.int32)))
    with pytest.raises(ValueError, match="pass layer="):
        stacked = jax.tree.map(lambda a: jnp.stack([a, a]), p)
        qm(x, stacked)
    with pytest.raises(TypeError, match="PackedWeight"):
        qm(x, jnp.zeros((48, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="unknown packed format 'int4'"):
        qm(x, packed_lib.replace(p, fmt="int4"))


@pytest.mark.parametrize(
    "fmt,m,cfg",
    [
        ("nvfp4", 3, None),  # the table / default decode config
        ("nvfp4", 20, autotune.Config(bm=16, bn=32, bk=64, split_k=2, scale_words=True)),
        ("mxfp4", 20, autotune.Config(bm=64, bn=64, bk=64, mode="dequant")),
        ("nf4", 70, None),
    ],
    ids=["decode", "splitk_words", "dequant", "prefill"],
)
def test_stacked_weights_read_in_place_equal_the_slice(fmt, m, cfg):
    """layer=l on an [L, N, K/2] stack (N = 72: a ragged last tile) equals the kernel on
    the sliced matrix, bit for bit, for a static and a traced layer index."""
    rng = _rng("stack", fmt, m)
    layers = [rand_packed(rng, 72, 256, fmt) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = rand_x(rng, m, 256)
    run = jax.jit(lambda x, l: forward_launch(x, *_args(stack), fmt=REGISTRY[fmt], interpret=True, cfg=cfg, layer=l, poison=True))
    for layer in range(3):
        want = forward_launch(x, *_args(layers[layer]), fmt=REGISTRY[fmt], interpret=True, cfg=cfg)
        assert rel_err(want, reference(x, layers[layer])) < TOL
        np.testing.assert_array_equal(np.asarray(run(x, jnp.int32(layer)), np.float32), np.asarray(want, np.float32))


def test_stacked_public_api_grad_and_errors():
    rng = _rng("stack_api")
    layers = [rand_packed(rng, 48, 64, "nvfp4") for _ in range(2)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = rand_x(rng, 5, 64)
    qm = pallas_kernels.quant_matmul
    np.testing.assert_array_equal(
        np.asarray(qm(x, stack, layer=1), np.float32), np.asarray(qm(x, layers[1]), np.float32)
    )
    g = jax.grad(lambda x: qm(x, stack, layer=jnp.int32(1)).astype(jnp.float32).sum())(x)
    g_ref = jax.grad(lambda x: reference(x, layers[1]).sum())(x)
    assert rel_err(g, g_ref) < TOL
    with pytest.raises(ValueError, match="stack of layers"):
        qm(x, layers[0], layer=0)
    with pytest.raises(ValueError, match="out of range"):
        qm(x, stack, layer=2)
    with pytest.raises(TypeError, match="integer scalar"):
        qm(x, stack, layer=1.0)


# ----------------------------------------------------------------------------- autotune


def test_autotune_lookup(monkeypatch):
    assert [autotune.m_bucket(m) for m in (1, 16, 17, 64, 65, 300, 5000)] == [16, 16, 32, 64, 256, 1024, 4096]
    entry = autotune.Config(bm=16, bn=128, bk=512, split_k=4, num_warps=8)
    monkeypatch.setattr(autotune, "_table", lambda: {"fwd:16:4096:11008": entry.to_dict()})
    assert autotune.get_config("fwd", 7, 4096, 11008) == entry
    default = autotune.get_config("fwd", 7, 4096, 4096)
    assert default == autotune.default_config("fwd", 7, 4096, 4096) and default.bm == 16
    block_entry = autotune.Config(bm=16, bn=64, bk=128, mode="block")
    monkeypatch.setattr(autotune, "_table", lambda: {"fwd:16:4096:11008": block_entry.to_dict()})
    assert autotune.get_config("fwd", 7, 4096, 11008) == block_entry
    assert autotune.get_config("fwd", 7, 4096, 11008, "nf4") == autotune.default_config("fwd", 7, 4096, 11008, "nf4")
    assert autotune.get_config("fwd", 4096, 4096, 4096).bm >= 64  # prefill tiles


def test_autotune_table_entries_are_valid_configs():
    for key, entry in autotune._table().items():
        kind, bucket, n, k = key.split(":")
        assert kind in ("fwd", "bwd") and int(bucket) in autotune.M_BUCKETS and int(n) > 0 and int(k) > 0
        cfg = autotune.Config(**entry)
        assert cfg.mode in ("fused", "dequant", "block")
        for size in (cfg.bm, cfg.bk, cfg.bc) + ((cfg.bn,) if kind == "fwd" else ()):
            assert size & (size - 1) == 0, (key, entry)


def test_stacks_between_2_and_4_gib_are_sliced_not_indexed_in_place(monkeypatch):
    """Pallas indexes arrays of 2-4 GiB with 32-bit offsets that overflow past 2 GiB; such
    stacks take the layer slice instead. Checked with the window moved down to this size."""
    qm = importlib.import_module("pallas_kernels.quant_matmul")  # the module, not the function

    rng = _rng("window")
    layers = [rand_packed(rng, 48, 64, "nvfp4") for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = rand_x(rng, 4, 64)
    codes, _, gs, row0 = qm._select_layer(*_args(stack), 2)
    assert codes.shape == (3 * 48, 32) and int(row0[0]) == 2 * 48
    monkeypatch.setattr(qm, "_I32_UNSAFE_BYTES", (stack.codes.nbytes - 1, stack.codes.nbytes))
    codes, _, gs, row0 = qm._select_layer(*_args(stack), 2)
    assert codes.shape == (48, 32) and int(row0[0]) == 0 and float(gs) == float(layers[2].global_scale)
    np.testing.assert_array_equal(
        np.asarray(pallas_kernels.quant_matmul(x, stack, layer=2), np.float32),
        np.asarray(pallas_kernels.quant_matmul(x, layers[2]), np.float32),
    )
