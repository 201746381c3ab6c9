"""The Mosaic GPU wgmma NVFP4 kernel's CPU-checkable parts: repacking and the register decode.

The kernel itself needs a Hopper GPU (Mosaic GPU has no CPU lowering); benchmarks/devtools/wgmma_probe.py
checks it there. Here: the load-time repack is exact and invertible, the scale re-encoding is
exact for every E4M3 value, and a numpy emulation of the kernel's PTX decode, placed by the
wgmma A-operand register layout, reproduces the dequantized weights.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import stream_k_partials

from pallas_kernels import wgmma_nvfp4 as wn
from qerl_jax.quant import quantize
from qerl_jax.quant.formats import REGISTRY


def _dequant_np(p):
    codes = np.asarray(p.codes)
    scales = np.asarray(p.scales.astype(jnp.float32))
    nib = np.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], -1)
    return np.asarray(REGISTRY["nvfp4"].code_table, np.float32)[nib] * np.repeat(scales, 16, axis=1)


def _weights(n, k, seed=0):
    w = jax.random.normal(jax.random.key(seed), (n, k), jnp.float32)
    w = w.at[:, :16].set(0.0)  # an all-zero block column: zero scales
    w = w.at[3, 16:32].set(1e-6 * w[3, 16:32])  # tiny block next to large ones: E4M3-subnormal scale
    return quantize(w, "nvfp4")


@pytest.mark.parametrize("n,k", [(64, 64), (128, 256), (192, 448)])
def test_repack_round_trip(n, k):
    p = _weights(n, k)
    words, swords = wn.repack(p.codes, p.scales)
    assert words.shape == (n // 64, k // 64, 4, 128) and words.dtype == jnp.uint32
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


def run_ptx(asm, *inputs):
    """A numpy interpreter for the few PTX instructions the kernel's inline asm uses: $0 = output,
    $1.. = inputs (uint32 arrays). Registers are uint32 (.b32) or uint16 (.b16) arrays."""
    regs = {f"${i + 1}": np.asarray(x, np.uint32) for i, x in enumerate(inputs)}

    def val(tok):
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    for stmt in asm.strip().strip("{}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        pack = re.match(r"\{(\w+), (\w+)\}, (.+)$", rest)  # mov.b32 {lo, hi}, q (unpack)
        if op == "mov.b32" and pack:
            q = val(pack.group(3))
            regs[pack.group(1)], regs[pack.group(2)] = (q & 0xFFFF).astype(np.uint16), (q >> 16).astype(np.uint16)
            continue
        d, *args = [a.strip() for a in re.split(r",(?![^{]*\})", rest)]
        if op == "mov.b32" and args[0].startswith("{"):  # mov.b32 s, {lo, hi} (pack)
            lo, hi = args[0].strip("{}").split(", ")
            r = regs[lo].astype(np.uint32) | (regs[hi].astype(np.uint32) << 16)
        elif op == "mov.b32":
            r = val(args[0])
        elif op == "and.b32":
            r = val(args[0]) & val(args[1])
        elif op == "shl.b32":
            r = val(args[0]) << np.uint32(int(args[1]))
        elif op == "shf.l.wrap.b32":  # funnel shift of (a:b) = rotate when a == b
            n = int(args[2]) % 32
            r = (val(args[1]) << np.uint32(n)) | (val(args[0]) >> np.uint32(32 - n))
        elif op == "lop3.b32":
            a, b, c, lut = val(args[0]), val(args[1]), val(args[2]), int(args[3], 0)
            r = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
            for bit in range(8):  # LUT index = (a << 2) | (b << 1) | c, as lop3's 0xF0 / 0xCC / 0xAA
                ma = a if bit & 4 else ~a
                mb = b if bit & 2 else ~b
                mc = c if bit & 1 else ~c
                if lut >> bit & 1:
                    r = r | (ma & mb & mc)
        elif op == "prmt.b32":  # default mode: selector nibble k picks byte k of the result
            src = [(val(args[0]) >> np.uint32(8 * j)) & 0xFF for j in range(4)]
            src += [(val(args[1]) >> np.uint32(8 * j)) & 0xFF for j in range(4)]
            sel = int(args[2], 0)
            r = sum(src[(sel >> (4 * k)) & 7] << np.uint32(8 * k) for k in range(4))
        elif op == "mad.lo.u32":
            r = val(args[0]) * val(args[1]) + val(args[2])
        elif op == "mul.rn.bf16x2":
            halves = [
                _bf16_round(
                    _bf16_bits_to_f32((val(args[0]) >> s) & 0xFFFF) * _bf16_bits_to_f32((val(args[1]) >> s) & 0xFFFF)
                )
                for s in (np.uint32(0), np.uint32(16))
            ]
            r = (halves[0].view(np.uint32) >> 16) | (halves[1].view(np.uint32) & np.uint32(0xFFFF0000))
        else:
            raise NotImplementedError(op)
        regs[d] = np.asarray(r).astype(np.uint32)
    return regs["$0"]


def emulate_decode(words, swords):
    """The kernel's decode: its inline PTX (`wn.scale_asm`, `wn.register_asm`) interpreted, the
    registers placed by wgmma's A layout -> float32 [N, K] = decoded bf16 W (value x 2**-8)."""
    words = np.asarray(words).astype(np.uint32)
    swords = np.asarray(swords).astype(np.uint32)  # [nt, kt, 64 rows]
    nt, kt = words.shape[:2]
    out = np.zeros((nt, kt, 64, 64), np.float32)
    for t in range(128):
        warp, lane = divmod(t, 32)
        sword = [swords[:, :, 16 * warp + 8 * h + lane // 4] for h in range(2)]  # rows r0, r0 + 8
        for b in range(4):
            sreg = run_ptx(wn.scale_asm(b), sword[b // 2])
            for i in range(4):
                reg = run_ptx(wn.register_asm(i), words[:, :, b, t], sreg)
                for v in range(2):  # the two bf16 lanes of the register
                    row = 16 * warp + 8 * (i % 2) + lane // 4
                    col = 16 * b + 8 * (i // 2) + 2 * (lane % 4) + v
                    out[:, :, row, col] = _bf16_bits_to_f32((reg >> np.uint32(16 * v)) & 0xFFFF)
    return out.transpose(0, 2, 1, 3).reshape(nt * 64, kt * 64)


def test_ptx_interpreter_on_known_values():
    """The interpreter itself, on hand-computed cases (so the decode test rests on it)."""
    assert run_ptx("{ shf.l.wrap.b32 $0, $1, $1, 9; }", 0x80000001) == 0x300
    assert run_ptx("{ lop3.b32 $0, $1, $2, 0xff00ff00, 0xf8; }", 0x0F, 0x1234_5678) == 0x1200_560F
    assert run_ptx("{ prmt.b32 $0, $1, 0, 0x4341; }", 0xAABBCCDD) == 0x00AA00CC
    assert run_ptx("{ mad.lo.u32 $0, $1, 16, 3; }", 5) == 83
    one_two = 0x4000_3F80  # bf16x2 (1.0, 2.0)
    assert (
        run_ptx(
            "{ .reg .b16 lo, hi; .reg .b32 s; mov.b32 {lo, hi}, $2; mov.b32 s, {hi, hi}; mul.rn.bf16x2 $0, $1, s; }",
            one_two,
            one_two,
        )
        == 0x4080_4000
    )


def test_code_bits_tile_the_word():
    pos = wn.code_bit_positions()
    assert sorted(pos.ravel()) == list(range(32))


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


def test_concat_keeps_each_weights_global_scale():
    """q/k/v-style weights of one K (different global scales) as one: the rows of each, exactly."""
    parts = [_weights(128, 192, seed=1), _weights(64, 192, seed=2), _weights(64, 192, seed=3)]
    parts[1] = parts[1].replace(global_scale=parts[1].global_scale * 3.0)  # another tensor scale
    fused = wn.concat([wn.from_packed(p) for p in parts])
    assert fused.shape == (256, 192) and fused.global_scale.shape == (256,)
    want = np.concatenate([np.asarray(quantize_dequant(p)) for p in parts])
    np.testing.assert_array_equal(np.asarray(wn.dequantize_wgmma(fused)), want)
    with pytest.raises(ValueError, match="one K"):
        wn.concat([wn.from_packed(parts[0]), wn.from_packed(_weights(64, 128))])


@pytest.mark.parametrize("m", [1, 5, 16])
def test_kernel_path_equals_the_matmul(monkeypatch, m):
    """wgmma_linear's kernel path (the Mosaic kernel replaced by its per-CTA emulation, which leaves
    NaN in the columns past M and in unwritten segments): stream-K combine, the slice to M rows and
    the per-row global scales of a concatenated weight give x @ W.T."""

    def cpu_twin(x, words, swords, *, n, tk, stages, wgs, ctas):
        w = wn.dequantize_repacked(words, swords, jnp.float32) * 2.0**-8
        return stream_k_partials(w, x, tk=tk, wgs=wgs, ctas=ctas)[0]

    monkeypatch.setattr(wn, "available", lambda: True)
    monkeypatch.setattr(wn, "wgmma_partials", cpu_twin)
    parts = [_weights(128, 256, seed=6), _weights(256, 256, seed=7)]
    parts[0] = parts[0].replace(global_scale=parts[0].global_scale * 0.5)
    fused = wn.concat([wn.from_packed(p) for p in parts])
    x = jax.random.normal(jax.random.key(m), (m, 256), jnp.float32).astype(jnp.bfloat16)
    got = np.asarray(wn.wgmma_linear(x, fused))
    want = np.asarray(x, np.float32) @ np.asarray(wn.dequantize_wgmma(fused)).T
    assert got.shape == (m, 384)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_index_arithmetic_has_no_sign_corrections():
    """The kernel's grid and block indices are >= 0 and use lax.div / lax.rem: jnp's // and % add
    `sign` corrections whose Mosaic GPU lowering cost ~3 s of Python for the 1.5B decode program
    (4 kernels), in every process that lowers it, warm compilation cache or not. Traced on the CPU."""
    from jax._src import core

    args = (
        jax.ShapeDtypeStruct((16, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 8, 4, 128), jnp.uint32),
        jax.ShapeDtypeStruct((4, 8, 64), jnp.uint32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    jaxpr = jax.make_jaxpr(lambda *a: wn.wgmma_matmul(*a, ctas=8))(*args)

    def primitives(j):
        for e in j.eqns:
            yield e.primitive.name
            for sub in core.jaxprs_in_params(e.params):
                yield from primitives(sub)

    names = list(primitives(jaxpr.jaxpr))
    assert "mpmd_map" in names or "pallas_call" in names, "the kernel was not traced"
    assert "sign" not in names
    assert names.count("div") > 0 and names.count("rem") > 0


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
        (16, 3584, 3584, dict(tk=128, stages=6, wgs=2)),  # q / o: 12.8M weights, 128-column steps
        (1, 18944, 3584, dict(tk=256, stages=6, wgs=2)),  # gate / up: 68M weights, 256-column steps
        (64, 5120, 27648, dict(tk=256, stages=3, wgs=2)),  # M = 64: the ring shrinks to shared memory
        (8, 192, 448, dict(tk=64, stages=6, wgs=1)),  # odd tiles: one warpgroup, 64-column steps
    ],
)
def test_kernel_config(m, n, k, want):
    cfg = wn.kernel_config(m, n, k)
    assert cfg == want
    assert wn.smem_bytes(wn.tile_rows(m), cfg["tk"], cfg["wgs"], cfg["stages"]) <= wn.SMEM_BUDGET


@pytest.mark.parametrize("n,k,tk,wgs,ctas", [(256, 1024, 128, 2, 5), (3584, 18944, 256, 2, 132), (192, 448, 64, 1, 7)])
def test_stream_plan_and_combine_equal_the_matmul(n, k, tk, wgs, ctas):
    """Each CTA's contiguous range of (row group, K step) items, summed per segment as the kernel
    does (emulated) and combined by `combine_partials`, gives x @ W.T."""
    rng = np.random.default_rng(n + k)
    x = rng.standard_normal((5, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    parts, seg_group, groups = stream_k_partials(jnp.asarray(w), jnp.asarray(x), tk=tk, wgs=wgs, ctas=ctas)
    assert parts.shape[0] == min(ctas, groups * (k // tk)) and parts.shape[2] == 8
    got = np.asarray(wn.combine_partials(parts[:, :, :5], seg_group, groups))
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-3)


def test_aligned_ctas_give_whole_fractions_of_a_row_group():
    """7B o_proj (28 groups of 128 rows, 28 K steps of 128): each aligned count's plan has no
    output summed from more than d segments, and the partial bytes count the real segments."""
    n, k, tk, wgs = 3584, 3584, 128, 2
    counts = wn.aligned_ctas(n, k, tk, wgs, 131)
    assert counts == [1, 2, 4, 7, 14, 28, 56, 112]
    for ctas in counts:
        _, nseg, seg_group = wn.stream_plan(n, k, tk, wgs, ctas)
        per_group = np.bincount(seg_group[seg_group < 28], minlength=28)
        assert per_group.min() == per_group.max() == max(1, ctas // 28)
        assert wn.partial_bytes(16, n, k, tk, wgs, ctas) == max(ctas, 28) * 16 * 128 * 4
    # one CTA per SM: 132 ranges over 784 steps cross group boundaries: 152 segments
    _, _, seg_group = wn.stream_plan(n, k, tk, wgs, 132)
    assert wn.partial_bytes(64, n, k, tk, wgs, 132) == int((seg_group < 28).sum()) * 64 * 128 * 4 > 4 * 28 * 64 * 512
    assert wn.partial_bytes(1, n, k, tk, wgs, 28) == 28 * 8 * 128 * 4  # M = 1 still stores Mp = 8 rows


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
