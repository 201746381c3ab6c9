"""NVFP4 W4A16 decode-regime matmul for Hopper in Pallas Mosaic GPU.

y [M, N] = x [M, K] @ dequant(W) [N, K].T for small M, with W fed to Hopper's wgmma from
registers: y.T tile [64, Mp] += W tile [64, tk] (decoded, registers) @ x.T tile [tk, Mp] (SMEM).

Why a second kernel: the Triton block kernel spends ~7 SASS instructions per weight (staging,
address arithmetic, an unfused zero accumulator); this one is written at the register level so
the K loop is the decode and the wgmma only (about 2.3 SASS instructions per weight, 1.1 of them
on the ALU pipe). The grid is persistent (one CTA per SM, stream-K over (row group, K step)
items; `stream_plan`).

Load-time repacking (`repack`), done once per weight and value-preserving:
- codes: each 64-row x 16-column block of the weight gives warpgroup thread t the 8 codes it holds
  in wgmma's A-operand layout (4 bf16x2 registers). Their 32 bits are packed into one uint32 word
  so that each register decodes with one or two ALU ops plus integer shifts (`REGISTER_SHIFTS`):
  register i = (rotl(word, a_i) & em mask) | ((word << b_i) & sign mask). Four 16-column blocks
  make four words per thread and 64 columns, stored word-major so a TMA row is 128 threads' words
  (512 bytes; thread-major rows of 16 bytes cut the TMA to ~1.4 TB/s). Layout: uint32 [N/64, K/64, 4, 128].
- block scales: the E4M3 byte is re-encoded as an unsigned 5-bit exponent / 3-bit mantissa
  byte (value 2**(e-9) * (1 + m/8)) that becomes the bf16 scale x 2**118 with one integer
  multiply-add, E4M3 subnormals included (zero scales keep zero codes). A thread holds rows r0 and
  r0 + 8 of wgmma's row layout; its two uint32 words (at rows r0 and r0 + 8 of a 64-row tile) hold
  both rows' scales of blocks 0, 1 and of blocks 2, 3, so one byte permute yields both rows' scales
  of a block, one per bf16 half. Layout: uint32 [N/64, K/64, 64].
The decoded weight is code x 2**-126 (E2M1 bit pattern in a bf16), times scale x 2**118: the
product is the value x 2**-8, undone with the global scale on the fp32 result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.numerics import exact_div

ROWS = 64  # rows of W per warpgroup (wgmma M)
KBLOCK = 64  # columns per block of a thread's four code words
SCALE_EXP_BIAS = 9  # re-encoded scale: 2**(e - 9) * (1 + m / 8); e in [0, 17]
_SCALE_BF16_ADD = (245 - SCALE_EXP_BIAS) << 7  # exponent offset to reach scale * 2**118
OUT_FACTOR = 2.0**8  # undoes 2**-126 (codes) x 2**118 (scales)


# Register i of a 16-column block: (rotate for the exponent/mantissa bits, shift for the sign).
# The 8 codes' bits tile the word exactly (tests/test_wgmma_nvfp4.py checks it and interprets the
# emitted PTX); a == b takes one mask, a <= 6 needs no rotation (the masked bits do not wrap).
REGISTER_SHIFTS = ((6, 6), (3, 3), (0, 4), (9, 5))
EM_MASK = 0x01C001C0  # bf16 bits 6-8 of both halves: E2M1 mantissa + exponent, 2**-126 scaled
SIGN_MASK = 0x80008000


def _thread_positions() -> tuple[np.ndarray, np.ndarray]:
    """rows, cols int [128, 4, 8]: the (row, column) of W, within a 64 x 64 tile, of code
    i + 4 v (register i, bf16 lane v) of code word b of thread t (column in 0..63)."""
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


@functools.cache
def code_bit_positions() -> np.ndarray:
    """int [8, 4]: the word bit holding bit j (m, e0, e1, sign) of code i + 4 v (register i, lane v)."""
    pos = np.zeros((8, 4), np.int64)
    for i, (a, b) in enumerate(REGISTER_SHIFTS):
        for v in range(2):
            for j, out_bit in enumerate((6, 7, 8)):  # E2M1 m, e0, e1 -> bf16 bits 6..8 of lane v
                pos[i + 4 * v, j] = (out_bit + 16 * v - a) % 32
            pos[i + 4 * v, 3] = 15 + 16 * v - b
    assert sorted(pos.ravel()) == list(range(32)), "REGISTER_SHIFTS must tile the word"
    assert (np.diff(pos[:, :3], axis=1) == 1).all(), "repack moves a code's E2M1 bits as one field"
    return pos


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
    """codes uint8 [N, K/2], scales e4m3 [N, K/16] -> (words uint32 [N/64, K/64, 4, 128],
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
    pos = code_bit_positions()  # a code's 3 exponent / mantissa bits stay adjacent; its sign moves
    em_pos, sign_pos = jnp.asarray(pos[:, 0], jnp.uint32), jnp.asarray(pos[:, 3], jnp.uint32)
    fields = ((gathered & 7) << em_pos) | ((gathered >> 3) << sign_pos)  # [nt, kt, 128, 4, 8]
    words = jnp.sum(fields, axis=-1, dtype=jnp.uint32)  # disjoint bits: sum == or
    words = words.transpose(0, 1, 3, 2)  # [nt, kt, 4 words, 128 threads]
    enc = encode_scales(scales).astype(jnp.uint32)  # [N, K/16]
    etiles = enc.reshape(n // ROWS, ROWS, k // KBLOCK, 4).transpose(0, 2, 1, 3)  # [nt, kt, 64, 4]
    src_row, src_block = _scale_sources()
    swords = jnp.sum(
        etiles[:, :, src_row, src_block] << (jnp.arange(4, dtype=jnp.uint32) * 8), axis=-1, dtype=jnp.uint32
    )
    return words, swords


@functools.cache
def _scale_sources() -> tuple[np.ndarray, np.ndarray]:
    """row, block int [64, 4]: the (row, 16-column block) whose scale byte j of scale word r holds.

    Word r0 (r0 % 16 < 8) = [s(0, r0), s(1, r0), s(0, r0 + 8), s(1, r0 + 8)] and word r0 + 8 the
    same for blocks 2, 3: the two words of the thread that holds rows r0 and r0 + 8."""
    row = np.zeros((ROWS, 4), np.int64)
    block = np.zeros((ROWS, 4), np.int64)
    for r in range(ROWS):
        r0, hi = r - 8 * (r % 16 >= 8), r % 16 >= 8
        for j in range(4):
            row[r, j], block[r, j] = r0 + 8 * (j // 2), 2 * hi + j % 2
    return row, block


@functools.cache
def _inverse_positions() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """thread, word, code int [64, 64]: where element (row, col) of a 64 x 64 tile lies."""
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


def e2m1_value(nib: jax.Array) -> jax.Array:
    """E2M1 codes (sign bit 3, exponent bits 1-2, mantissa bit 0) -> float32 values, exactly."""
    nib = nib.astype(jnp.int32)
    e, m = (nib >> 1) & 3, (nib & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.exp2((e - 1).astype(jnp.float32)))
    return jnp.where(nib & 8, -mag, mag)


def dequantize_repacked(words: jax.Array, swords: jax.Array, dtype=jnp.float32, global_scale=None) -> jax.Array:
    """Inverse of `repack`: codes x scales (/ global_scale, if given: float32 [] or per row [N], as
    `dequantize` does), `dtype` [N, K]."""
    nt, kt = words.shape[:2]
    t_idx, b_idx, k_idx = _inverse_positions()
    w_tile = words[:, :, b_idx, t_idx]  # [nt, kt, 64, 64]: the word holding each element
    pos = code_bit_positions()[k_idx]  # [64, 64, 4]: each element's bit positions in its word
    em_pos, sign_pos = jnp.asarray(pos[..., 0], jnp.uint32), jnp.asarray(pos[..., 3], jnp.uint32)
    nib = ((w_tile >> em_pos) & 7) | (((w_tile >> sign_pos) & 1) << 3)  # as `repack` placed the fields
    vals = e2m1_value(nib)
    sb = (swords[..., None] >> (jnp.arange(4, dtype=jnp.uint32) * 8)) & 0xFF  # [nt, kt, 64 words, 4 bytes]
    src_row, src_block = _scale_sources()
    enc = jnp.zeros(sb.shape, jnp.uint32).at[:, :, src_row, src_block].set(sb)  # [nt, kt, 64 rows, 4 blocks]
    block_scale = decode_scales(enc.astype(jnp.uint8))  # [nt, kt, 64, 4]
    if global_scale is not None:
        gs = jnp.asarray(global_scale, jnp.float32)
        block_scale = exact_div(block_scale, gs.reshape(nt, 1, ROWS, 1) if gs.ndim else gs)
    tile = (vals * jnp.repeat(block_scale, 16, axis=-1)).astype(dtype)
    return tile.transpose(0, 2, 1, 3).reshape(nt * ROWS, kt * KBLOCK)


@struct.dataclass
class WgmmaWeight:
    """An NVFP4 linear weight [N, K] in the wgmma kernel's layout (see the module docstring).

    Made from a `PackedWeight` with `from_packed` (once, e.g. per rollout); same values. Several
    weights of one K stack along N into one (`concat`), each keeping its global scale per row.
    """

    words: jax.Array  # uint32 [N/64, K/64, 4, 128]
    swords: jax.Array  # uint32 [N/64, K/64, 64]
    global_scale: jax.Array  # float32 [] or [N] (one per row: a `concat` of weights)

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0] * ROWS, self.words.shape[1] * KBLOCK


def layout_fits(fmt: str | None, shape: tuple[int, ...]) -> bool:
    """Whether NVFP4 weights of this format and [..., N, K] shape have the kernel's layout
    (N and K multiples of 64)."""
    return fmt == "nvfp4" and len(shape) >= 2 and shape[-2] % ROWS == 0 and shape[-1] % KBLOCK == 0


def supports(packed) -> bool:
    """Whether `from_packed` takes this weight: one NVFP4 matrix with N and K multiples of 64."""
    shape = getattr(packed, "shape", ())
    return len(shape) == 2 and layout_fits(getattr(packed, "fmt", None), shape)


def from_packed(packed) -> WgmmaWeight:
    """A `PackedWeight` (nvfp4, [N, K], N and K multiples of 64) -> `WgmmaWeight`."""
    if not supports(packed):
        raise ValueError(
            f"the wgmma kernel takes one nvfp4 [N, K] matrix with N and K multiples of 64; got "
            f"fmt={getattr(packed, 'fmt', None)!r}, shape={getattr(packed, 'shape', None)}"
        )
    words, swords = repack(packed.codes, packed.scales)
    return WgmmaWeight(words, swords, packed.global_scale.astype(jnp.float32))


def concat(weights: list[WgmmaWeight]) -> WgmmaWeight:
    """Weights [N_i, K] -> one [sum N_i, K] (rows in order; per-row global scales), so that
    projections of one input (q/k/v, gate/up) run as one kernel call."""
    ks = {w.shape[1] for w in weights}
    if len(ks) != 1:
        raise ValueError(f"concat needs weights of one K; got shapes {[w.shape for w in weights]}")
    scales = [jnp.broadcast_to(w.global_scale.astype(jnp.float32), (w.shape[0],)) for w in weights]
    return WgmmaWeight(
        jnp.concatenate([w.words for w in weights]),
        jnp.concatenate([w.swords for w in weights]),
        jnp.concatenate(scales),
    )


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
LARGE_WEIGHT = 32 * 2**20  # N x K from which 256-column steps beat 128 (H100; KERNEL_NOTES.md, "Design in use")


def tile_rows(m: int) -> int:
    """Mp: the rows of x's tile (and of each output segment), M rounded up to a multiple of 8."""
    return max(8, -(-m // 8) * 8)


def kernel_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tiling for [M, K] @ [N, K].T: K step tk, compute warpgroups (64 rows of W each), ring depth.

    Measured on H100 (benchmarks/devtools/wgmma_probe.py; KERNEL_NOTES.md): two warpgroups; tk = 256
    for the large MLP projections, 128 for q / o; the ring as deep as shared memory allows (<= 6).
    """
    wgs = 2 if n % (2 * ROWS) == 0 else 1
    tk = 256 if k % 256 == 0 and n * k >= LARGE_WEIGHT else (128 if k % 128 == 0 else KBLOCK)
    return dict(tk=tk, stages=fit_stages(tile_rows(m), tk, wgs, 6), wgs=wgs)


def wgmma_linear(x_MxK: jax.Array, w: WgmmaWeight) -> jax.Array:
    """x [M, K] @ W.T -> float32 [M, N]: the kernel for M <= MAX_ROWS on Hopper (x in bf16), else
    dequantize to x's dtype + XLA dot (prefill, or a machine without the kernel)."""
    m, k = x_MxK.shape
    n, k_w = w.shape
    if k != k_w:
        raise ValueError(f"x has K={k} but the weight is [{n}, {k_w}]")
    if m <= MAX_ROWS and available():
        return _wgmma_y(x_MxK, w.words, w.swords, w.global_scale, **kernel_config(m, n, k))
    w_NxK = dequantize_wgmma(w, x_MxK.dtype)
    return jax.lax.dot_general(x_MxK, w_NxK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# The kernel (GPU only: Mosaic GPU has no CPU lowering; `dequantize_wgmma` + dot is the CPU twin,
# and tests/test_wgmma_nvfp4.py emulates the decode bit by bit).


def scale_asm(b: int) -> str:
    """PTX: scale word $1 -> $0 = bf16 scales (x 2**118) of block b, row r0 in the low half and
    r0 + 8 in the high half (prmt: the two rows' bytes into the halves; mad: x16 + exponent offset)."""
    sel = 0x4240 + (b % 2) * 0x101
    return f"{{ .reg .b32 p; prmt.b32 p, $1, 0, {sel:#x}; mad.lo.u32 $0, p, 16, {_SCALE_BF16_ADD * 0x10001:#x}; }}"


def register_asm(i: int) -> str:
    """PTX: code word $1, block scales $2 (from `scale_asm`) -> $0 = bf16x2 A-operand register i
    (row half i % 2): the two codes' bits moved into bf16 bits 6-8 and 15, times the row's scale."""
    a, b = REGISTER_SHIFTS[i]
    if a == b:
        bits = f"shl.b32 t, $1, {a}; and.b32 t, t, {EM_MASK | SIGN_MASK:#x};"
    else:
        em = "mov.b32 u, $1;" if a == 0 else (f"shl.b32 u, $1, {a};" if a <= 6 else f"shf.l.wrap.b32 u, $1, $1, {a};")
        bits = f"{em} and.b32 u, u, {EM_MASK:#x}; shl.b32 t, $1, {b}; lop3.b32 t, u, t, {SIGN_MASK:#x}, 0xf8;"
    half = "lo, lo" if i % 2 == 0 else "hi, hi"  # ptxas folds the broadcast into HMUL2's .H0_H0 / .H1_H1
    return (
        "{ .reg .b32 t, u, s; .reg .b16 lo, hi; " + bits + f" mov.b32 {{lo, hi}}, $2; mov.b32 s, {{{half}}};"
        " mul.rn.bf16x2 $0, t, s; }"
    )


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
            _words_layout(),
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

        sword = [elem(swords.registers[0, 0, 0, h, 0, 0], 0) for h in range(2)]  # rows r0, r0 + 8
        for b in range(4):
            w = elem(words.registers.flat[b], 0)  # thread t's word b
            sreg = llvm.inline_asm(i32, [sword[b // 2]], scale_asm(b), "=r,r")
            for i in range(4):
                out = llvm.inline_asm(i32, [w, sreg], register_asm(i), "=r,r,r")
                idx = [0] * regs.ndim
                idx[1], idx[4] = 2 * b + i // 2, i % 2  # column tile of 8, row half
                regs[tuple(idx)] = mgpu_utils.bitcast(out, bf16x2)
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return decode


def stream_plan(n: int, k: int, tk: int, wgs: int, ctas: int) -> tuple[int, int, np.ndarray]:
    """Stream-K split of the flat (row group, K step) space over `ctas` persistent CTAs.

    Returns (ctas, segments per CTA J, group int [ctas, J]): the row group of each CTA's output
    segment (the groups its contiguous range of steps touches, in order), or G (a dummy) where
    a CTA has fewer than J segments."""
    groups, steps = n // (ROWS * wgs), k // tk
    flat = groups * steps
    ctas = min(ctas, flat)
    start = np.arange(ctas + 1) * flat // ctas
    first, last = start[:-1] // steps, (start[1:] - 1) // steps
    nseg = int((last - first).max()) + 1
    seg_group = np.full((ctas, nseg), groups, np.int64)
    for c in range(ctas):
        seg_group[c, : last[c] - first[c] + 1] = np.arange(first[c], last[c] + 1)
    return ctas, nseg, seg_group


def partial_bytes(m: int, n: int, k: int, tk: int, wgs: int, ctas: int) -> int:
    """Bytes of float32 partial sums the kernel writes (and the combine reads back) for M rows:
    one [Mp, 64 wgs] segment per (CTA, row group its stream-K range touches). Split-K traffic on
    top of the weight's: at M = 64 with one CTA per SM, 2 x 22% of a 7B layer's packed weight bytes."""
    groups = n // (ROWS * wgs)
    _, _, seg_group = stream_plan(n, k, tk, wgs, ctas)
    return int((seg_group < groups).sum()) * tile_rows(m) * ROWS * wgs * 4


def aligned_ctas(n: int, k: int, tk: int, wgs: int, max_ctas: int) -> list[int]:
    """CTA counts <= max_ctas whose stream-K ranges are 1/d of a row group (groups x d, d dividing
    the K steps) or e whole row groups (groups / e): no output gets more than d partial sums."""
    groups, steps = n // (ROWS * wgs), k // tk
    split = {groups * d for d in range(1, steps + 1) if steps % d == 0}
    whole = {groups // e for e in range(1, groups + 1) if groups % e == 0}
    return sorted(c for c in split | whole if c <= max_ctas)


def num_sms() -> int:
    """Streaming multiprocessors of the first device (132 on an H100 SXM when unknown)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except RuntimeError:
        return 132


@functools.partial(jax.jit, static_argnames=("n", "tk", "stages", "wgs", "ctas"))
def wgmma_partials(x, words, swords, *, n: int, tk: int, stages: int, wgs: int = 2, ctas: int = 132):
    """The kernel: `ctas` persistent CTAs (stream-K), each streaming a contiguous range of the flat
    (row group of 64 wgs rows, K step) space through one warp-specialized pipeline: a TMA
    warpgroup fills a `stages`-deep SMEM ring of [Mp, tk] x and code / scale words, and `wgs`
    compute warpgroups decode and multiply. A CTA writes its accumulator out (and restarts it)
    when its range leaves a row group, so there is no per-tile prologue and no wave tail.

    x bf16 [M, K] -> float32 [ctas, J, Mp, 64 wgs] (Mp: M rounded up to 8; TMA reads the missing
    rows of x as zeros, and output rows >= M are not meaningful): each CTA's partial sums of
    y x 2**-8 x gs, one per row group of W its range touches (`stream_plan` says which; unused
    segments are unwritten). The accumulator is y.T (W is wgmma's A operand); it is stored
    transposed (WGMMA_TRANSPOSED register layout into a transposed SMEM view), so the output
    needs no XLA transpose.

    Long because the producer and consumer warpgroups share its SMEM ring, barriers and range
    arithmetic as closures: split apart, each piece would take a dozen of them as arguments.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    mp = tile_rows(m)
    nj = tk // KBLOCK
    steps = k // tk
    if k % tk:
        raise ValueError(f"K={k} must split into whole {tk}-column steps")
    if n % (ROWS * wgs):
        raise ValueError(f"N={n} must be a multiple of {ROWS * wgs} for {wgs} warpgroups")
    ctas, nseg, _ = stream_plan(n, k, tk, wgs, ctas)
    flat = (n // (ROWS * wgs)) * steps
    max_len = -(-flat // ctas)
    decode = _decode_fn()
    div, rem = jax.lax.div, jax.lax.rem
    x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def wgmma_nvfp4_stream(x_gmem, w_gmem, s_gmem, o_gmem, o_smem):
        cta = jax.lax.axis_index("c")
        # Every index here is >= 0, so lax.div / lax.rem equal // and %; jnp's floor versions add
        # sign corrections whose Mosaic GPU lowering took ~3 s of Python per program (4 kernels).
        start = div(cta * flat, ctas)
        length = div((cta + 1) * flat, ctas) - start
        first_group = div(start, steps)

        def flat_step(i):  # dummy steps past a short range re-read its last step (never flushed)
            return start + jnp.minimum(i, length - 1)

        def group_and_step(i):  # (row group, K step) of pipeline step i
            return div(flat_step(i), steps), rem(flat_step(i), steps)

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS, mp), jnp.float32))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wait_smem_to_gmem(0)

        def body(idx, x_smem, w_smem, s_smem, acc_ref):
            wg = jax.lax.axis_index("wg")
            for j in range(nj):
                cw = plgpu.load(w_smem.at[wg, pl.ds(j, 1)], (), layout=_words_layout())
                sw = plgpu.load(s_smem.at[wg, pl.ds(j, 1)], (), layout=_row_layout(), optimized=False)
                plgpu.wgmma(acc_ref, decode(cw, sw), _transpose(x_smem.at[:, pl.ds(j * KBLOCK, KBLOCK)]))
            plgpu.wgmma_wait(0)
            i = idx[0]
            f = start + i
            flush = (i < length) & ((rem(f, steps) == steps - 1) | (i == length - 1))

            @pl.when(flush)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous flush has left o_smem
                # y.T [64, Mp] -> the [Mp, 64] tile: a register layout whose vectors run along W's
                # rows (one shuffle + permute), stored through the transposed view of the tile.
                acc_t = plgpu.layout_cast(acc_ref[...], plgpu.Layout.WGMMA_TRANSPOSED)
                _transpose(o_smem.at[wg])[...] = acc_t
                plgpu.commit_smem()
                seg = div(f, steps) - first_group
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[cta, seg, :, pl.ds(wg * ROWS, ROWS)])

            acc_ref[...] = acc_ref[...] * jnp.where(flush, 0.0, 1.0).astype(jnp.float32)
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(max_len,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((mp, tk), lambda i: (0, rem(flat_step(i), steps)), transforms=x_transforms),
                plgpu.BlockSpec((wgs, nj, 4, 128), lambda i: (*group_and_step(i), 0, 0)),
                plgpu.BlockSpec((wgs, nj, ROWS), lambda i: (*group_and_step(i), 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )(x_gmem, w_gmem, s_gmem)

    return plgpu.kernel(
        wgmma_nvfp4_stream,
        out_type=jax.ShapeDtypeStruct((ctas, nseg, mp, wgs * ROWS), jnp.float32),
        scratch_types=[plgpu.SMEM((wgs, mp, ROWS), jnp.float32)],
        grid=(ctas,),
        grid_names=("c",),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(x, words, swords)


def wgmma_matmul(x, words, swords, global_scale, *, tk: int = 128, stages: int = 6, wgs: int = 2, ctas: int = 0):
    """x bf16 [M, K] @ repacked NVFP4 W [N, K].T -> bf16 [M, N] (fp32 accumulation); `ctas`
    persistent CTAs (0: one per SM)."""
    y = _wgmma_y(x, words, swords, global_scale, tk=tk, stages=stages, wgs=wgs, ctas=ctas)
    return y.astype(jnp.bfloat16)


def _wgmma_y(x, words, swords, global_scale, *, tk: int, stages: int, wgs: int, ctas: int = 0) -> jax.Array:
    """float32 y [M, N] of x [M, K] @ W.T through the kernel (global scale [] or per row of W [N])."""
    m, k = x.shape
    n = words.shape[0] * ROWS
    ctas, _, seg_group = stream_plan(n, k, tk, wgs, ctas or num_sms())
    parts = wgmma_partials(x.astype(jnp.bfloat16), words, swords, n=n, tk=tk, stages=stages, wgs=wgs, ctas=ctas)
    y = combine_partials(parts[:, :, :m], seg_group, n // (ROWS * wgs))
    return y * (OUT_FACTOR / global_scale.astype(jnp.float32))


def combine_partials(parts: jax.Array, seg_group: np.ndarray, groups: int) -> jax.Array:
    """float32 [ctas, J, M, R] per-CTA segment sums (`wgmma_partials`) -> y [M, groups R]: summed
    per row group as `stream_plan`'s seg_group [ctas, J] says (entries == groups: unused).

    A static gather + sum (one XLA fusion with what follows), not a scatter-add; the segments are
    stored row-major in y's layout, so putting the groups side by side moves 512-byte runs."""
    _, _, m, rows = parts.shape
    flat = seg_group.ravel()
    sources = [np.flatnonzero(flat == g) for g in range(groups)]
    width = max(len(src) for src in sources)
    idx = np.full((groups, width), flat.size, np.int32)  # out of range: filled with zeros
    for g, src in enumerate(sources):
        idx[g, : len(src)] = src
    gathered = parts.reshape(-1, m, rows).at[idx].get(mode="fill", fill_value=0.0)  # [G, P, M, R]
    return jnp.sum(gathered, axis=1).transpose(1, 0, 2).reshape(m, groups * rows)


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


def _words_layout():
    """One 64-column block of code words [1, 4, 128]: thread t holds words [0, b, t], b = 0..3."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.Layout.WG_STRIDED((1, 4, 128), vec_size=1)


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
