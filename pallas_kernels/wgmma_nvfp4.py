"""NVFP4 W4A16 decode-regime matmul for Hopper in Pallas Mosaic GPU.

y [M, N] = x [M, K] @ dequant(W) [N, K].T for small M, with W fed to Hopper's wgmma from
registers: y.T tile [64, Mp] += W tile [64, tk] (decoded, registers) @ x.T tile [tk, Mp] (SMEM).

Why a second kernel: the Triton block kernel spends ~7 SASS instructions per weight (staging,
address arithmetic, an unfused zero accumulator); this one is written at the register level so
the K loop is the decode and the wgmma only (about 3 per weight).

Load-time repacking (`repack`), done once per weight and value-preserving:
- codes: each 64-row x 16-column block of nibbles is permuted so that warpgroup thread t finds
  the 8 nibbles it holds in wgmma's A-operand layout in one uint32 word, in the order the
  decode emits them; four 16-column blocks make one 128-bit word per thread and 64 columns.
  Layout: uint32 [N/64, K/64, 128, 4].
- block scales: the E4M3 byte is re-encoded as an unsigned 5-bit exponent / 3-bit mantissa
  byte (value 2**(e-9) * (1 + m/8)) that becomes the bf16 scale x 2**118 with one integer
  multiply-add, E4M3 subnormals included (zero scales keep zero codes). One uint32 per row and
  64 columns (its four block scales), uint32 [N/64, K/64, 64]; a thread reads the words of its
  two rows (wgmma's row layout: the four threads of a row share them).
The decoded weight is code x 2**-126 (E2M1 bit pattern in a bf16), times scale x 2**118: the
product is the value x 2**-8, undone with the global scale on the fp32 result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

ROWS = 64  # rows of W per warpgroup (wgmma M)
KBLOCK = 64  # columns per 128-bit code word of a thread
SCALE_EXP_BIAS = 9  # re-encoded scale: 2**(e - 9) * (1 + m / 8); e in [0, 17]
_SCALE_BF16_ADD = (245 - SCALE_EXP_BIAS) << 7  # exponent offset to reach scale * 2**118
OUT_FACTOR = 2.0**8  # undoes 2**-126 (codes) x 2**118 (scales)


def _thread_positions() -> tuple[np.ndarray, np.ndarray]:
    """rows, cols int [128, 4, 8]: the (row, column) of W, within a 64 x 64 tile, of nibble k
    of code word b of thread t (column in 0..63)."""
    rows = np.zeros((128, 4, 8), np.int64)
    cols = np.zeros((128, 4, 8), np.int64)
    for t in range(128):
        warp, lane = divmod(t, 32)
        r0, q = 16 * warp + lane // 4, lane % 4
        for b in range(4):
            for i in range(4):  # output register i: column tile 2b + i // 2, row half i % 2
                row = r0 + 8 * (i % 2)
                col = 16 * b + 8 * (i // 2) + 2 * q
                rows[t, b, i], cols[t, b, i] = row, col  # bf16 lane 0 (low half)
                rows[t, b, i + 4], cols[t, b, i + 4] = row, col + 1  # bf16 lane 1 (high half)
    return rows, cols


def encode_scales(scales_e4m3: jax.Array) -> jax.Array:
    """E4M3 block scales [...] -> uint8 e5m3 bytes (2**(e-9) * (1 + m/8)); zero maps to 0."""
    s = scales_e4m3.astype(jnp.float32)
    mant, exp = jnp.frexp(jnp.maximum(s, 2.0**-9))  # s = mant * 2**exp, mant in [0.5, 1)
    e = exp - 1 + SCALE_EXP_BIAS
    m = jnp.round((mant * 2.0 - 1.0) * 8.0).astype(jnp.int32)
    return jnp.where(s > 0, (e << 3) | m, 0).astype(jnp.uint8)


def decode_scales(enc: jax.Array) -> jax.Array:
    """Inverse of `encode_scales` for nonzero scales (a zero scale reads back as 2**-9)."""
    e = (enc >> 3).astype(jnp.int32)
    m = (enc & 7).astype(jnp.float32)
    return jnp.ldexp(1.0 + m / 8.0, e - SCALE_EXP_BIAS)


def repack(codes: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """codes uint8 [N, K/2], scales e4m3 [N, K/16] -> (words uint32 [N/64, K/64, 128, 4],
    scale words uint32 [N/64, K/64, 64]). N and K must be multiples of 64."""
    n, half_k = codes.shape
    k = 2 * half_k
    if n % ROWS or k % KBLOCK:
        raise ValueError(f"wgmma nvfp4 layout needs N and K multiples of 64, got N={n}, K={k}")
    nib = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(n, k)
    zero_block = scales.astype(jnp.float32) == 0
    nib = jnp.where(jnp.repeat(zero_block, 16, axis=1), 0, nib)
    tiles = nib.reshape(n // ROWS, ROWS, k // KBLOCK, KBLOCK).transpose(0, 2, 1, 3)  # [nt, kt, 64, 64]
    rows, cols = _thread_positions()
    gathered = tiles[:, :, rows, cols].astype(jnp.uint32)  # [nt, kt, 128, 4, 8]
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    words = jnp.sum(gathered << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bits: sum == or
    enc = encode_scales(scales).astype(jnp.uint32)  # [N, K/16]
    etiles = enc.reshape(n // ROWS, ROWS, k // KBLOCK, 4).transpose(0, 2, 1, 3)  # [nt, kt, 64, 4]
    swords = jnp.sum(etiles << (jnp.arange(4, dtype=jnp.uint32) * 8), axis=-1, dtype=jnp.uint32)
    return words, swords


@functools.cache
def _inverse_positions() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """thread, word, nibble int [64, 64]: where element (row, col) of a 64 x 64 tile lies."""
    rows, cols = _thread_positions()
    t_idx = np.zeros((ROWS, KBLOCK), np.int64)
    b_idx = np.zeros((ROWS, KBLOCK), np.int64)
    k_idx = np.zeros((ROWS, KBLOCK), np.int64)
    for t in range(128):
        for b in range(4):
            for k in range(8):
                r, c = rows[t, b, k], cols[t, b, k]
                t_idx[r, c], b_idx[r, c], k_idx[r, c] = t, b, k
    return t_idx, b_idx, k_idx


def dequantize_repacked(words: jax.Array, swords: jax.Array, dtype=jnp.float32, global_scale=None) -> jax.Array:
    """Inverse of `repack`: codes x scales (/ global_scale, if given, as `dequantize` does), `dtype` [N, K]."""
    from qerl_jax.quant.packed import CODE_TABLES, exact_div

    nt, kt = words.shape[:2]
    t_idx, b_idx, k_idx = _inverse_positions()
    w_tile = words[:, :, t_idx, b_idx]  # [nt, kt, 64, 64]: the word holding each element
    nib = (w_tile >> (jnp.asarray(k_idx, jnp.uint32) * 4)) & 0xF
    vals = jnp.asarray(CODE_TABLES["nvfp4"], jnp.float32)[nib.astype(jnp.int32)]
    sb = (swords[..., None] >> (jnp.arange(4, dtype=jnp.uint32) * 8)) & 0xFF  # [nt, kt, 64, 4]
    block_scale = decode_scales(sb.astype(jnp.uint8))  # [nt, kt, 64, 4]
    if global_scale is not None:
        block_scale = exact_div(block_scale, global_scale)
    tile = (vals * jnp.repeat(block_scale, 16, axis=-1)).astype(dtype)
    return tile.transpose(0, 2, 1, 3).reshape(nt * ROWS, kt * KBLOCK)


@struct.dataclass
class WgmmaWeight:
    """An NVFP4 linear weight [N, K] in the wgmma kernel's layout (see the module docstring).

    Made from a `PackedWeight` with `from_packed` (once, e.g. per rollout); same values.
    """

    words: jax.Array  # uint32 [N/64, K/64, 128, 4]
    swords: jax.Array  # uint32 [N/64, K/64, 64]
    global_scale: jax.Array  # float32 []

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0] * ROWS, self.words.shape[1] * KBLOCK


def supports(packed) -> bool:
    """Whether `from_packed` takes this weight: one NVFP4 matrix with N and K multiples of 64."""
    shape = getattr(packed, "shape", None)
    return (
        getattr(packed, "fmt", None) == "nvfp4" and len(shape) == 2 and shape[0] % ROWS == 0 and shape[1] % KBLOCK == 0
    )


def from_packed(packed) -> WgmmaWeight:
    """A `PackedWeight` (nvfp4, [N, K], N and K multiples of 64) -> `WgmmaWeight`."""
    if not supports(packed):
        raise ValueError(
            f"the wgmma kernel takes one nvfp4 [N, K] matrix with N and K multiples of 64; got "
            f"fmt={getattr(packed, 'fmt', None)!r}, shape={getattr(packed, 'shape', None)}"
        )
    words, swords = repack(packed.codes, packed.scales)
    return WgmmaWeight(words, swords, packed.global_scale.astype(jnp.float32))


def dequantize_wgmma(w: WgmmaWeight, dtype=jnp.float32) -> jax.Array:
    """The weight's values [N, K] in `dtype` (global scale applied)."""
    return dequantize_repacked(w.words, w.swords, dtype, w.global_scale)


def available() -> bool:
    """True on a Hopper GPU (sm_90) where Mosaic GPU kernels can run."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


MAX_ROWS = 64  # the kernel's regime; larger M goes through dequantize + dot
TARGET_CTAS = 264  # split K until the grid has about two CTAs per SM of an H100


def kernel_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tiling for [M, K] @ [N, K].T: 64-column code words, K steps of tk, split-K, warpgroups.

    Measured on H100 (benchmarks/wgmma_probe.py, RESULTS.md): two compute warpgroups, tk = 128
    and a grid of about two CTAs per SM are the best or within noise of it for the Qwen2.5-7B /
    32B projections at M = 16; the ring is as deep as shared memory allows, up to 6 stages.
    """
    wgs = 2 if n % (2 * ROWS) == 0 else 1
    tk = 128 if k % 128 == 0 else KBLOCK
    mp = max(8, -(-m // 8) * 8)
    return dict(tk=tk, splits=pick_splits(n, k, tk, wgs), stages=fit_stages(mp, tk, wgs, 6), wgs=wgs)


def pick_splits(n: int, k: int, tk: int, wgs: int, target: int = TARGET_CTAS) -> int:
    """The smallest split-K count dividing K / tk that gives a grid of at least `target` CTAs
    (N / (64 wgs) x splits), else one split per K step."""
    steps = k // tk
    return next((d for d in range(1, steps + 1) if steps % d == 0 and n // (ROWS * wgs) * d >= target), steps)


def wgmma_linear(x_MxK: jax.Array, w: WgmmaWeight) -> jax.Array:
    """x [M, K] @ W.T -> float32 [M, N]: the kernel for M <= MAX_ROWS on Hopper (x in bf16), else
    dequantize to x's dtype + XLA dot (prefill, or a machine without the kernel)."""
    m, k = x_MxK.shape
    n, k_w = w.shape
    if k != k_w:
        raise ValueError(f"x has K={k} but the weight is [{n}, {k_w}]")
    if m <= MAX_ROWS and available():
        cfg = kernel_config(m, n, k)
        return wgmma_matmul(x_MxK.astype(jnp.bfloat16), w.words, w.swords, w.global_scale, **cfg).astype(jnp.float32)
    w_NxK = dequantize_wgmma(w, x_MxK.dtype)
    return jax.lax.dot_general(x_MxK, w_NxK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# The kernel (GPU only: Mosaic GPU has no CPU lowering; `dequantize_wgmma` + dot is the CPU twin,
# and tests/test_wgmma_nvfp4.py emulates the decode bit by bit).


def _decode_fn():
    """inline_mgpu decode of one 64-column block: code words [1,128,4] + scale words [1,64] ->
    bf16 [64, 64] in the wgmma A layout."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental import mosaic as _  # noqa: F401
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.Layout.WG_STRIDED((1, 128, 4), vec_size=4),
            _row_layout(),
        ),
        return_type=plgpu.ShapeDtypeStruct((ROWS, KBLOCK), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def decode(ctx, words, swords):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        layout = mgpu.WGMMA_LAYOUT
        regs = np.empty(layout.registers_shape((ROWS, KBLOCK)), dtype=object)

        def elem(vec, i):
            return llvm.extractelement(vec, mgpu_utils.c(i, i32))

        wv = words.registers.flat[0]
        srow = [elem(swords.registers[0, 0, 0, h, 0, 0], 0) for h in range(2)]  # rows r0, r0 + 8
        for b in range(4):
            w = elem(wv, b)
            sreg = []
            for h in range(2):
                sel = 0x4040 | (b << 8) | b  # block b's byte into both bf16 halves
                sreg.append(
                    llvm.inline_asm(
                        i32,
                        [srow[h]],
                        f"{{ .reg .b32 p; prmt.b32 p, $1, 0, {sel:#x}; "
                        f"mad.lo.u32 $0, p, 16, {_SCALE_BF16_ADD * 0x10001:#x}; }}",
                        "=r,r",
                    )
                )
            for i in range(4):
                shift = 4 * (3 - i)
                shl = f"shl.b32 t, $1, {shift};" if shift else "mov.b32 t, $1;"
                out = llvm.inline_asm(
                    i32,
                    [w, sreg[i % 2]],
                    "{ .reg .b32 t, u; " + shl + " and.b32 u, t, 0x70007000; shr.b32 u, u, 6;"
                    " lop3.b32 u, t, 0x80008000, u, 0xEA; mul.rn.bf16x2 $0, u, $2; }",
                    "=r,r,r",
                )
                idx = [0] * regs.ndim
                idx[1], idx[4] = 2 * b + i // 2, i % 2  # column tile of 8, row half
                regs[tuple(idx)] = mgpu_utils.bitcast(out, bf16x2)
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return decode


@functools.partial(jax.jit, static_argnames=("n", "splits", "tk", "stages", "wgs", "profile_dir"))
def wgmma_partials(
    x_p, words, swords, *, n: int, splits: int, tk: int, stages: int, wgs: int = 1, profile_dir: str = ""
):
    """x_p bf16 [Mp, K] (Mp % 8 == 0) -> float32 [splits, N, Mp]: partial sums of y.T x 2**-8 x gs.

    Grid (N / (64 wgs), splits); each CTA runs `wgs` compute warpgroups (64 rows of W each) fed by
    a TMA warpgroup through a `stages`-deep SMEM ring of [Mp, tk] x and code / scale words.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mp, k = x_p.shape
    nj = tk // KBLOCK
    steps_total = k // tk
    if k % tk or steps_total % splits:
        raise ValueError(f"K={k} must split into {splits} x whole {tk}-column steps")
    if n % (ROWS * wgs):
        raise ValueError(f"N={n} must be a multiple of {ROWS * wgs} for {wgs} warpgroups")
    steps = steps_total // splits
    decode = _decode_fn()
    x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(x_gmem, w_gmem, s_gmem, o_gmem, o_smem):
        group = jax.lax.axis_index("n")
        split = jax.lax.axis_index("s")

        def compute_context(eval_pipeline):
            wg = jax.lax.axis_index("wg")

            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS, mp), jnp.float32))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                o_smem.at[wg][...] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[split, pl.ds((group * wgs + wg) * ROWS, ROWS)])
                plgpu.wait_smem_to_gmem(0)

        def body(_, x_smem, w_smem, s_smem, acc_ref):
            wg = jax.lax.axis_index("wg")
            # 64-column chunks: chunk j's wgmma runs while chunk j + 1 decodes. Each chunk's A
            # operand is a distinct value in straight-line code; across steps (a loop) the same
            # PTX registers are rewritten, so every step ends with all its wgmmas complete.
            for j in range(nj):
                with jax.named_scope("decode"):
                    cw = plgpu.load(
                        w_smem.at[wg, pl.ds(j, 1)], (), layout=plgpu.Layout.WG_STRIDED((1, 128, 4), vec_size=4)
                    )
                    sw = plgpu.load(s_smem.at[wg, pl.ds(j, 1)], (), layout=_row_layout(), optimized=False)
                    a = decode(cw, sw)
                plgpu.wgmma(acc_ref, a, _transpose(x_smem.at[:, pl.ds(j * KBLOCK, KBLOCK)]))
            with jax.named_scope("wgmma_wait"):
                plgpu.wgmma_wait(0)
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((mp, tk), lambda s: (0, split * steps + s), transforms=x_transforms),
                plgpu.BlockSpec((wgs, nj, 128, 4), lambda s: (group, split * steps + s, 0, 0)),
                plgpu.BlockSpec((wgs, nj, ROWS), lambda s: (group, split * steps + s, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )(x_gmem, w_gmem, s_gmem)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, mp), jnp.float32),
        scratch_types=[plgpu.SMEM((wgs, ROWS, mp), jnp.float32)],
        grid=(n // (ROWS * wgs), splits),
        grid_names=("n", "s"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            **(dict(profile_space=512, profile_dir=profile_dir) if profile_dir else {}),
        ),
    )(x_p, words, swords)


SMEM_BUDGET = 220 * 1024  # H100: 227 KB per block, minus barriers and slack


def smem_bytes(mp: int, tk: int, wgs: int, stages: int) -> int:
    """Shared memory of one CTA: `stages` x (x tile + code words + scale words) + the output tile."""
    per_stage = mp * tk * 2 + wgs * (tk // KBLOCK) * (128 * 4 * 4 + ROWS * 4)
    return stages * per_stage + wgs * ROWS * mp * 4


def fit_stages(mp: int, tk: int, wgs: int, stages: int) -> int:
    """The largest stage count <= `stages` whose ring fits in shared memory (at least 2)."""
    while stages > 2 and smem_bytes(mp, tk, wgs, stages) > SMEM_BUDGET:
        stages -= 1
    return stages


def _row_layout():
    """wgmma's row layout (thread holds rows r0 and r0 + 8; the 4 threads of a row share them)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    r = mgpu.WGMMA_ROW_LAYOUT
    return plgpu.Layout.TILED(r.tiling, warp_dims=r.warp_dims, lane_dims=r.lane_dims, vector_dim=r.vector_dim)


def _transpose(ref):
    """[R, C] SMEM ref -> its [C, R] view (ref.transpose on new jax, transpose_ref on 0.10)."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.transpose_ref(ref, (1, 0))


def wgmma_matmul(x, words, swords, global_scale, *, splits: int = 1, tk: int = 128, stages: int = 4, wgs: int = 1):
    """x bf16 [M, K] @ repacked NVFP4 W [N, K].T -> bf16 [M, N] (fp32 accumulation)."""
    m, k = x.shape
    n = words.shape[0] * ROWS
    mp = max(8, -(-m // 8) * 8)
    x_p = jnp.pad(x.astype(jnp.bfloat16), ((0, mp - m), (0, 0)))
    parts = wgmma_partials(x_p, words, swords, n=n, splits=splits, tk=tk, stages=stages, wgs=wgs)
    y_t = jnp.sum(parts, axis=0) * (OUT_FACTOR / global_scale.astype(jnp.float32))  # W = codes x scales / gs
    return y_t[:, :m].T.astype(jnp.bfloat16)
