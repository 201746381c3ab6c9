"""W4A16 matmul on packed 4-bit weights (NVFP4 / MXFP4 / NF4) in Pallas (Triton lowering).

    y [M, N] = x [M, K] @ dequantize(packed).T        (x bf16, y float32; float32 accumulation)

The kernels read the `PackedWeight` layout as stored (codes uint8 [N, K/2], low nibble =
even k; scales [N, K/block]; a scalar global scale): no repacking. Per K step a program
loads a tile of code bytes and their block scales, decodes the nibbles to bf16 already
multiplied by the block scale (`decode_asm`: byte-permute lookups, one bf16 rounding),
and feeds them to a tensor-core dot with the x tile; the global scale divides the fp32
accumulator once at the end, and y is written in float32: the caller's epilogue (bias, LoRA)
adds to the unrounded product and rounds once, as the dense path does.

Regimes, picked from M and the autotune table (`autotune.get_config`):
- nvfp4, M <= 256 ("block" mode, `_fwd_block_kernel`, one M tile): the codes are read as
  [N, K/16, 8] (one row of 8 bytes per 16-weight block; a free view of the stored layout)
  and decoded with plain integer ops (`_decode_block`), which Triton keeps in the
  tensor-core operand layout: no shared-memory round trip of the decoded tile (the PTX
  decode below forces one; KERNEL_NOTES.md has the profiles);
- decode (M <= 64, memory-bound): x padded to 16/32/64 rows, narrow N tiles (64) so that
  every SM streams weights, split-K with an XLA reduction when N tiles are too few, and
  optionally W as the dot's left operand (`swap`, y.T = W @ x.T);
- M > 64 ("dequant" mode): a Pallas kernel writes W as bf16 with the same decode, then an
  XLA / cuBLAS dot (the fused kernel with [bm, bn] tiles and a grouped program order, still
  selectable by config, was measured slower there; KERNEL_NOTES.md).

Backward (`jax.custom_vjp`): dx = dy @ dequantize(W) by a second kernel that walks the
same packed layout with the contraction over N (or dequant + dot for M > 64); W is
frozen (no cotangent for codes / scales / global scale).

`interpret=None` runs the Pallas interpreter when the default backend is CPU (the nibble
decode then uses jnp selects instead of PTX), the compiled Triton kernel otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import autotune, decode_asm
from pallas_kernels.formats import KernelFormat, decode_jnp, scales_to_bf16

_DECODES = ("asm", "jnp", "bits")
# "bits" is the block kernel's GPU decode ("asm" selects it there): E2M1 nibbles placed into
# bf16 bit patterns worth value * 2**-126 (code 1, 0.5, is the subnormal 2**-127), times the
# block scale pre-multiplied by 2**_BITS_PRE (exact: 448 * 2**118 < the bf16 maximum); the
# accumulator is multiplied back by 2**(126 - _BITS_PRE). XLA on CPU flushes subnormals, so
# interpret mode uses the "jnp" decode instead (tests/test_quant_matmul.py checks the bit
# formula itself exactly in numpy).
_BITS_PRE = 118
_BITS_MASK = -0x7E3F7E40  # 0x81C081C0 as int32: sign + 3 value bits of both halves


# ----------------------------------------------------------------------------- validation


def _validate(x: Any, packed: Any, names: tuple[str, ...] | None = None) -> tuple[KernelFormat, int, int, int]:
    """Checks x and packed before anything is traced into a kernel; returns (fmt, M, N, K)."""
    for field in ("codes", "scales", "global_scale", "format"):
        if not hasattr(packed, field):
            raise TypeError(
                f"packed must be a PackedWeight (codes, scales, global_scale, format); got {type(packed).__name__}"
            )
    fmt = KernelFormat.of(packed.format)
    if names is not None and fmt.name not in names:
        raise ValueError(f"packed.format must be one of {names}, got {fmt.name!r}")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    if len(x.shape) != 2:
        raise ValueError(f"x must be 2-D [M, K] (flatten leading axes first), got shape {tuple(x.shape)}")
    if x.dtype != jnp.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    codes, scales, gs = packed.codes, packed.scales, packed.global_scale
    if codes.ndim != 2:
        raise ValueError(
            f"packed.codes must be 2-D [N, K/2] (one matrix; for a stack of layers pass layer=...), "
            f"got shape {tuple(codes.shape)}"
        )
    if codes.dtype != jnp.uint8:
        raise TypeError(f"packed.codes must be uint8, got {codes.dtype}")
    n, k = codes.shape[0], 2 * codes.shape[1]
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"K mismatch: x has K={x.shape[1]} but packed.codes {tuple(codes.shape)} holds K={k}")
    block = fmt.block_size
    if k % block:
        raise ValueError(f"K={k} must be a multiple of the {fmt.name} block size {block}")
    if tuple(scales.shape) != (n, k // block):
        raise ValueError(f"packed.scales must have shape {(n, k // block)} for {fmt.name}, got {tuple(scales.shape)}")
    if scales.dtype != fmt.scale_dtype:
        raise TypeError(f"packed.scales must be {fmt.scale_dtype} for {fmt.name}, got {scales.dtype}")
    if int(np.prod(gs.shape)) != 1:
        raise ValueError(f"packed.global_scale must be a scalar, got shape {tuple(gs.shape)}")
    if not jnp.issubdtype(gs.dtype, jnp.floating):
        raise TypeError(f"packed.global_scale must be floating point, got {gs.dtype}")
    if n == 0 or k == 0:
        raise ValueError(f"empty weight: N={n}, K={k}")
    return fmt, m, n, k


def _resolve_interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap dividing x."""
    d = 1
    while d * 2 <= cap and x % (d * 2) == 0:
        d *= 2
    return d


def _compiler_params(cfg: autotune.Config) -> Any:
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------- tile decode


def _decode_tile(codes, scales, fmt: KernelFormat, decode: str, words=None) -> jax.Array:
    """uint8 codes [R, C/2] + raw scales [R, C/block] -> bf16 weight tile [R, C] (scaled).

    words: the lookup words as int32 scalars loaded by the kernel (see `_table_input`).
    """
    r, half = codes.shape
    block = fmt.block_size
    nb = scales.shape[1]
    s = scales_to_bf16(scales, fmt)
    if decode == "asm":
        # Per scale a bf16 pair (s, s) in one 32-bit word, broadcast to its code bytes.
        bits = jax.lax.bitcast_convert_type(s, jnp.uint16).astype(jnp.uint32)
        s2 = bits | (bits << 16)
        s2 = jnp.broadcast_to(s2[:, :, None], (r, nb, block // 2)).reshape(r, half)
        table = np.asarray(fmt.code_table, np.float32)
        extra = [jnp.broadcast_to(w, (r, half)) for w in words] if words is not None else []
        [pairs] = plgpu.elementwise_inline_asm(
            decode_asm.ptx(table, words_as_operands=words is not None),
            args=[codes, s2, *extra],
            constraints=decode_asm.constraints(table, words_as_operands=words is not None),
            pack=4,
            # int32, not uint32: the asm result type must be a signless integer.
            result_shape_dtypes=[jax.ShapeDtypeStruct((r, half), jnp.int32)],
        )
        even = jax.lax.bitcast_convert_type(pairs.astype(jnp.uint16), jnp.bfloat16)
        odd = jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(pairs, 16).astype(jnp.uint16), jnp.bfloat16)
    else:
        s = jnp.broadcast_to(s[:, :, None], (r, nb, block // 2)).reshape(r, half)  # per code byte
        even, odd = decode_jnp(codes, s, fmt)
    return jnp.stack([even, odd], axis=-1).reshape(r, 2 * half)


def _kernel_scales(scales: jax.Array) -> jax.Array:
    """e4m3 scales travel as their bytes (a free bitcast): masked loads can then fill 0."""
    if scales.dtype == jnp.float8_e4m3fn:
        return jax.lax.bitcast_convert_type(scales, jnp.uint8)
    return scales


def _scale_words_ok(fmt: KernelFormat, k: int, bk: int) -> bool:
    """Whether 1-byte scales can be loaded as int32 words for this K and K step."""
    per_word = 4 * fmt.block_size
    return fmt.scale_dtype.itemsize == 1 and k % per_word == 0 and bk % per_word == 0


def _as_words(scales: jax.Array) -> jax.Array:
    """uint8-sized scales [N, S] -> int32 [N, S / 4] (little-endian: scale 4j + i in byte i)."""
    s = _kernel_scales(scales)
    n, ns = s.shape
    return jax.lax.bitcast_convert_type(s.reshape(n, ns // 4, 4), jnp.int32)


def _unpack_words(w: jax.Array) -> jax.Array:
    """int32 [R, W] -> uint8 [R, 4 W], the inverse of `_as_words` on a tile."""
    r, nw = w.shape
    shifts = 8 * jax.lax.broadcasted_iota(jnp.int32, (r, nw, 4), 2)
    b = jax.lax.shift_right_logical(jnp.broadcast_to(w[:, :, None], (r, nw, 4)), shifts) & 0xFF
    return b.reshape(r, 4 * nw).astype(jnp.uint8)


def _table_input(fmt: KernelFormat) -> jax.Array:
    """The PTX lookup words as an int32 array input: loaded at run time, ptxas keeps them
    in registers (as immediates it re-materialised one before every lookup)."""
    words = np.array(decode_asm.table_words(np.asarray(fmt.code_table, np.float32)), np.uint32).view(np.int32)
    return jnp.asarray(np.pad(words, (0, 8 - words.size)))


def _load_words(t_ref, fmt: KernelFormat, decode: str):
    if decode != "asm":
        return None
    return [t_ref[j] for j in range(len(decode_asm.table_words(np.asarray(fmt.code_table, np.float32))))]


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """Tensor-core dot with fp32 accumulation (lax.dot_general; pl.dot is gone in jax 0.12)."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)


def _iota(n: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _load(ref, idx, mask, other):
    if mask is None:
        return ref[idx]
    return plgpu.load(ref.at[idx], mask=mask, other=other)


def _load_w_tile(c_ref, s_ref, w0, k0, rows: int, bk: int, fmt: KernelFormat, scale_words: bool = False, valid=None):
    """The packed W tile at row w0, column k0: uint8 codes [rows, bk/2] and raw scales [rows,
    bk/block] (loaded as int32 words and unpacked with scale_words). valid: bool [rows] (rows
    past N read as 0) or None when every row exists."""
    block = fmt.block_size

    def mask(cols):
        return None if valid is None else jnp.broadcast_to(valid[:, None], (rows, cols))

    # multiple_of on every column start: Pallas lowers `//` with sign fix-ups that hide the
    # alignment from Triton, which then loads the scales byte by byte, unpipelined.
    c = _load(c_ref, (pl.ds(w0, rows), pl.ds(pl.multiple_of(k0 // 2, bk // 2), bk // 2)), mask(bk // 2), 0)
    if scale_words:
        per_word = 4 * block
        col = pl.multiple_of(k0 // per_word, bk // per_word)
        words = _load(s_ref, (pl.ds(w0, rows), pl.ds(col, bk // per_word)), mask(bk // per_word), 0)
        return c, _unpack_words(words)
    col = pl.multiple_of(k0 // block, bk // block)
    return c, _load(s_ref, (pl.ds(w0, rows), pl.ds(col, bk // block)), mask(bk // block), 0)


# ----------------------------------------------------------------------------- forward kernel


def _fwd_kernel(x_ref, c_ref, s_ref, g_ref, r_ref, t_ref, *rest, fmt, m, n, cfg, k_chunk, decode):
    """r_ref: the first row of this weight in c_ref / s_ref (layer * N for stacked weights)."""
    o_ref = rest[-1]  # rest = (o_ref,) or (poison_in_ref, o_ref)
    words = _load_words(t_ref, fmt, decode)
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    num_m, num_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
    pid = pl.program_id(0)
    if num_m == 1:
        pid_m, pid_n = 0, pid
    else:  # grouped order: group_m row-tiles share each W column-tile while it is in L2
        group = cfg.group_m * num_n
        first_m = (pid // group) * cfg.group_m
        size_m = jnp.minimum(num_m - first_m, cfg.group_m)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
    ks = pl.program_id(1)
    m0 = pid_m * bm
    n0 = pid_n * bn
    rows_m = m0 + _iota(bm)
    rows_n = n0 + _iota(bn)
    mask_x = None if m % bm == 0 else jnp.broadcast_to((rows_m < m)[:, None], (bm, bk))
    valid_n = None if n % bn == 0 else rows_n < n
    k_base = ks * k_chunk
    w0 = r_ref[0] + n0  # first weight row of the tile

    def body(i, acc):
        k0 = pl.multiple_of(k_base + i * bk, bk)
        x = _load(x_ref, (pl.ds(m0, bm), pl.ds(k0, bk)), mask_x, 0.0)
        c, s = _load_w_tile(c_ref, s_ref, w0, k0, bn, bk, fmt, cfg.scale_words, valid_n)
        w = _decode_tile(c, s, fmt, decode, words)
        if cfg.swap:
            return acc + _dot(w, x, contract=(1, 1))  # [bn, bm]
        return acc + _dot(x, w, contract=(1, 1))  # [bm, bn]

    acc_shape = (bn, bm) if cfg.swap else (bm, bn)
    acc = jax.lax.fori_loop(0, k_chunk // bk, body, jnp.zeros(acc_shape, jnp.float32))
    acc = acc * (1.0 / g_ref[0])
    if cfg.swap:
        acc = acc.T
    out = acc.astype(o_ref.dtype)
    row0 = m0 if cfg.split_k == 1 else ks * m + m0
    idx = (pl.ds(row0, bm), pl.ds(n0, bn))
    if m % bm == 0 and n % bn == 0:
        o_ref[idx] = out
    else:
        mask = (rows_m < m)[:, None] & (rows_n < n)[None, :]
        plgpu.store(o_ref.at[idx], out, mask=mask)


def decode_bits_pairs(c: jax.Array) -> jax.Array:
    """nvfp4 code bytes (int32, any shape) -> int32 whose low / high 16 bits are the bf16 bit
    patterns of the low / high nibble's E2M1 value times 2**-126.

    c * 0x1001 & 0xF000F moves the nibbles to bits 0-3 and 16-19; * 0x1040 adds copies
    shifted by 6 (the 3 value bits land on the exponent's two low bits and the top mantissa
    bit) and by 12 (the sign, bit 3, lands on bit 15); no two copies overlap, and the mask
    keeps the placed bits. Four integer ops for two weights.
    """
    return (((c * 0x1001) & 0xF000F) * 0x1040) & _BITS_MASK


def _decode_block(c: jax.Array, s: jax.Array, fmt: KernelFormat, decode: str) -> jax.Array:
    """nvfp4 codes int32 [R, NB, 8] (byte j of block b: k = 16 b + 2 j, + 1) and raw e4m3
    scale bytes uint8 [R, NB] -> bf16 W [R, 16 NB], times 2**(_BITS_PRE - 126) for "bits"."""
    r, nb, _ = c.shape
    sb = jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn).astype(jnp.bfloat16)
    if decode == "bits":
        p = decode_bits_pairs(c)
        lo = jax.lax.bitcast_convert_type(p.astype(jnp.uint16), jnp.bfloat16)
        hi = jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(p, 16).astype(jnp.uint16), jnp.bfloat16)
        # multiply after the join, so that each product is one bf16x2 op on the (lo, hi) pair
        w = jnp.stack([lo, hi], axis=-1) * (sb * jnp.bfloat16(2.0**_BITS_PRE))[:, :, None, None]
    else:
        even, odd = decode_jnp(c.astype(jnp.uint8), jnp.broadcast_to(sb[:, :, None], c.shape), fmt)
        w = jnp.stack([even, odd], axis=-1)
    return w.reshape(r, 16 * nb)


def _fwd_block_kernel(x_ref, c_ref, s_ref, g_ref, r_ref, *rest, fmt, m, n, k, cfg, k_chunk, decode):
    """nvfp4, M <= 256: one [bm, bn] tile of y (or of a split-K partial) per program; with
    cfg.swap the decoded W is the dot's left operand (y.T = W @ x.T: Hopper's wgmma, which
    takes that operand from registers).

    c_ref: codes viewed as [R, K/16, 8]; s_ref: e4m3 scale bytes [R, K/16]; r_ref: the
    first row of this weight (layer * N for stacked weights).
    """
    o_ref = rest[-1]
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    nb = bk // 16
    n0 = pl.program_id(0) * bn
    ks = pl.program_id(1)
    rows_m = _iota(bm)
    rows_n = n0 + _iota(bn)
    mask_x = None if m % bm == 0 else jnp.broadcast_to((rows_m < m)[:, None], (bm, bk))
    mask_c = mask_s = None
    if n % bn:
        mask_c = jnp.broadcast_to((rows_n < n)[:, None, None], (bn, nb, 8))
        mask_s = jnp.broadcast_to((rows_n < n)[:, None], (bn, nb))
    w0 = r_ref[0] + n0

    def body(i, acc):
        # block index without a division, so Triton sees the alignment (vector loads of scales)
        kb = pl.multiple_of(ks * (k_chunk // 16) + i * nb, nb)
        x = _load(x_ref, (pl.ds(0, bm), pl.ds(pl.multiple_of(kb * 16, bk), bk)), mask_x, 0.0)
        c = _load(c_ref, (pl.ds(w0, bn), pl.ds(kb, nb), pl.ds(0, 8)), mask_c, 0)
        s = _load(s_ref, (pl.ds(w0, bn), pl.ds(kb, nb)), mask_s, 0)
        w = _decode_block(c.astype(jnp.int32), s, fmt, decode)
        if cfg.swap:
            return acc + _dot(w, x, contract=(1, 1))  # [bn, bm]
        return acc + _dot(x, w, contract=(1, 1))

    acc = jax.lax.fori_loop(0, k_chunk // bk, body, jnp.zeros((bn, bm) if cfg.swap else (bm, bn), jnp.float32))
    post = 2.0 ** (126 - _BITS_PRE) if decode == "bits" else 1.0
    out = (acc * (post / g_ref[0])).astype(o_ref.dtype)
    if cfg.swap:
        out = out.T
    idx = (pl.ds(ks * m, bm), pl.ds(n0, bn))
    if m % bm == 0 and n % bn == 0:
        o_ref[idx] = out
    else:
        plgpu.store(o_ref.at[idx], out, mask=(rows_m < m)[:, None] & (rows_n < n)[None, :])


_I32_UNSAFE_BYTES = (2**31, 2**32)  # array sizes (bytes) Pallas indexes with overflowing 32-bit offsets


def _select_layer(codes, scales, gs, layer):
    """-> (codes [R, K/2], scales [R, K/B], scalar global scale, first row int32 [1]).

    For stacked weights the [L, N, ...] arrays are viewed as [L * N, ...] (a free reshape)
    and the first row is layer * N; a 2-D weight starts at row 0.
    """
    if layer is None:
        return codes, scales, gs, jnp.zeros((1,), jnp.int32)
    layer = jnp.asarray(layer, jnp.int32)
    if any(_I32_UNSAFE_BYTES[0] < a.size * a.dtype.itemsize <= _I32_UNSAFE_BYTES[1] for a in (codes, scales)):
        # Pallas' Triton lowering indexes arrays of up to 4 GiB with 32-bit offsets, which
        # overflow past 2 GiB (illegal address; e.g. the Qwen2.5-72B q/o stacks): slice the
        # layer out instead (a copy of one layer per call).
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
        return pick(codes), pick(scales), pick(jnp.reshape(gs, (-1,))), jnp.zeros((1,), jnp.int32)
    num_layers, n = codes.shape[0], codes.shape[1]
    return (
        codes.reshape(num_layers * n, codes.shape[2]),
        scales.reshape(num_layers * n, scales.shape[2]),
        jnp.reshape(gs, (num_layers,))[layer],
        jnp.reshape(layer * n, (1,)),
    )


def _fwd_config(m: int, n: int, k: int, fmt: KernelFormat, cfg: autotune.Config | None) -> tuple[autotune.Config, int]:
    """Fits a (table or given) config to the problem; returns it and the K chunk per split."""
    cfg = cfg or autotune.get_config("fwd", m, n, k, fmt.name)
    if cfg.mode == "block" and (fmt.name != "nvfp4" or m > autotune.BLOCK_MAX_M):
        cfg = autotune.default_config("fwd", m, n, k, fmt.name, block=False)
    if cfg.mode == "block":  # one M tile; W on the left (wgmma) from M = 33
        bm = max(16, 1 << (m - 1).bit_length())
        cfg = dataclasses.replace(cfg, bm=bm, swap=cfg.swap or m >= autotune.BLOCK_SWAP_FROM_M)
    block = fmt.block_size
    min_bk = max(16, block)
    if m <= autotune.DECODE_MAX_M or cfg.swap:
        cfg = dataclasses.replace(cfg, bm=max(16, 1 << (m - 1).bit_length()) if m <= autotune.DECODE_MAX_M else cfg.bm)
    split_k = cfg.split_k
    if k % (split_k * min_bk):  # the table's split does not fit this K: no split
        split_k = 1
    k_chunk = k // split_k
    bk = _pow2_divisor(k_chunk, cfg.bk)
    if bk < min_bk:  # only when K is not a multiple of 16 * 2**i: fall back to one block
        bk = min_bk
    cfg = dataclasses.replace(
        cfg, bk=bk, split_k=split_k, scale_words=cfg.scale_words and _scale_words_ok(fmt, k_chunk, bk)
    )
    return cfg, k_chunk


def _launch(kernel, args: list, *, out_shape, grid, cfg, interpret: bool, poison: bool, name: str) -> jax.Array:
    """pallas_call of `kernel` on `args`; `poison` passes a NaN-filled output buffer aliased to
    the result, so that any element the kernel fails to write shows."""
    aliases = {}
    if poison:
        args = [*args, jnp.full(out_shape.shape, jnp.nan, out_shape.dtype)]
        aliases = {len(args) - 1: 0}
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=_compiler_params(cfg),
        name=name,
    )(*args)


def _launch_split_k(kernel, args: list, *, m: int, n: int, grid, cfg, interpret: bool, poison: bool, name: str):
    """A forward launch writing y float32 [M, N], or with cfg.split_k > 1 float32 partials
    [split_k * M, N] that XLA sums into y."""
    split = cfg.split_k > 1
    out_shape = jax.ShapeDtypeStruct((cfg.split_k * m, n) if split else (m, n), jnp.float32)
    y = _launch(kernel, args, out_shape=out_shape, grid=grid, cfg=cfg, interpret=interpret, poison=poison, name=name)
    if split:
        y = y.reshape(cfg.split_k, m, n).sum(axis=0)
    return y


def forward_launch(
    x,
    codes,
    scales,
    gs,
    *,
    fmt: KernelFormat,
    interpret: bool,
    decode: str | None = None,
    cfg: autotune.Config | None = None,
    poison: bool = False,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """The forward launch (no custom_vjp); `poison` NaN-fills the kernel's output first.

    layer: with stacked weights (codes [L, N, K/2], scales [L, N, K/B], gs [L]) the layer
    to multiply by; the kernel reads its rows in place (no slice copy of the stack).

    Over 60 lines only for its argument lists: one branch per launch mode, each a call.
    """
    fmt = KernelFormat.of(fmt)
    n = codes.shape[-2]
    codes, scales, gs, row0 = _select_layer(codes, scales, gs, layer)
    m, k = x.shape
    if m == 0:
        return jnp.zeros((0, n), jnp.float32)
    decode = decode or ("jnp" if interpret else "asm")
    if decode not in _DECODES:
        raise ValueError(f"decode must be one of {_DECODES}, got {decode!r}")
    cfg, k_chunk = _fwd_config(m, n, k, fmt, cfg)
    if cfg.mode == "dequant":
        w = _dequantize(codes, scales, gs, fmt=fmt, interpret=interpret, decode=decode, n=n, row0=row0)
        return dot_nt(x, w)
    if cfg.mode == "block":
        return _forward_block(
            x,
            codes,
            scales,
            gs,
            row0,
            fmt=fmt,
            n=n,
            cfg=cfg,
            k_chunk=k_chunk,
            interpret=interpret,
            decode="bits" if decode == "asm" else decode,
            poison=poison,
        )
    decode = "asm" if decode == "bits" else decode  # the fast GPU decode of the 2-D tile kernels
    num_tiles = pl.cdiv(m, cfg.bm) * pl.cdiv(n, cfg.bn)
    kernel = functools.partial(_fwd_kernel, fmt=fmt, m=m, n=n, cfg=cfg, k_chunk=k_chunk, decode=decode)
    s_arg = _as_words(scales) if cfg.scale_words else _kernel_scales(scales)
    args = [x, codes, s_arg, jnp.reshape(gs.astype(jnp.float32), (1,)), row0, _table_input(fmt)]
    return _launch_split_k(
        kernel,
        args,
        m=m,
        n=n,
        grid=(num_tiles, cfg.split_k),
        cfg=cfg,
        interpret=interpret,
        poison=poison,
        name=f"w4a16_{fmt.name}_fwd",
    )


def _forward_block(x, codes, scales, gs, row0, *, fmt, n, cfg, k_chunk, interpret, decode, poison):
    """The launch of `_fwd_block_kernel` (nvfp4, M <= 256); split-K partials summed by XLA."""
    m, k = x.shape
    kernel = functools.partial(_fwd_block_kernel, fmt=fmt, m=m, n=n, k=k, cfg=cfg, k_chunk=k_chunk, decode=decode)
    args = [
        x,
        codes.reshape(codes.shape[0], k // 16, 8),  # a free view: 8 code bytes per 16-weight block
        _kernel_scales(scales),
        jnp.reshape(gs.astype(jnp.float32), (1,)),
        row0,
    ]
    return _launch_split_k(
        kernel,
        args,
        m=m,
        n=n,
        grid=(pl.cdiv(n, cfg.bn), cfg.split_k),
        cfg=cfg,
        interpret=interpret,
        poison=poison,
        name="w4a16_nvfp4_block_fwd",
    )


# ----------------------------------------------------------------------------- backward kernel


def _bwd_kernel(dy_ref, c_ref, s_ref, g_ref, t_ref, *rest, fmt, m, n, k, cfg, decode):
    """dx [M, K] = dy [M, N] @ W [N, K]; one [bm, bk] tile of dx per program, loop over N."""
    o_ref = rest[-1]
    words = _load_words(t_ref, fmt, decode)
    bm, bk, bc = cfg.bm, cfg.bk, cfg.bc
    num_m, num_k = pl.cdiv(m, bm), k // bk
    pid = pl.program_id(0)
    if num_m == 1:
        pid_m, pid_k = 0, pid
    else:
        group = cfg.group_m * num_k
        first_m = (pid // group) * cfg.group_m
        size_m = jnp.minimum(num_m - first_m, cfg.group_m)
        pid_m = first_m + (pid % group) % size_m
        pid_k = (pid % group) // size_m
    m0 = pid_m * bm
    k0 = pid_k * bk
    rows_m = m0 + _iota(bm)
    ragged_m, ragged_n = m % bm != 0, n % bc != 0

    def body(i, acc):
        n0 = pl.multiple_of(i * bc, bc)
        cols_n = n0 + _iota(bc)
        mask_dy = None
        if ragged_m or ragged_n:
            mask_dy = jnp.broadcast_to((rows_m < m)[:, None] & (cols_n < n)[None, :], (bm, bc))
        dy = _load(dy_ref, (pl.ds(m0, bm), pl.ds(n0, bc)), mask_dy, 0.0)
        c, s = _load_w_tile(c_ref, s_ref, n0, k0, bc, bk, fmt, valid=cols_n < n if ragged_n else None)
        w = _decode_tile(c, s, fmt, decode, words)  # [bc, bk]
        return acc + _dot(dy, w, contract=(1, 0))

    acc = jax.lax.fori_loop(0, pl.cdiv(n, bc), body, jnp.zeros((bm, bk), jnp.float32))
    out = (acc * (1.0 / g_ref[0])).astype(o_ref.dtype)
    idx = (pl.ds(m0, bm), pl.ds(k0, bk))
    if ragged_m:
        plgpu.store(o_ref.at[idx], out, mask=jnp.broadcast_to((rows_m < m)[:, None], (bm, bk)))
    else:
        o_ref[idx] = out


def backward_launch(
    dy,
    codes,
    scales,
    gs,
    *,
    fmt: KernelFormat,
    interpret: bool,
    decode: str | None = None,
    cfg: autotune.Config | None = None,
    poison: bool = False,
) -> jax.Array:
    """dx [M, K] bf16 = dy [M, N] @ dequantize(W) [N, K], fp32 accumulation."""
    fmt = KernelFormat.of(fmt)
    m, n = dy.shape
    k = 2 * codes.shape[1]
    if m == 0:
        return jnp.zeros((0, k), jnp.bfloat16)
    decode = {None: "jnp" if interpret else "asm", "bits": "asm"}.get(decode, decode)
    cfg = cfg or autotune.get_config("bwd", m, n, k)
    if cfg.mode == "dequant":
        w = _dequantize(codes, scales, gs, fmt=fmt, interpret=interpret, decode=decode)
        dx = jax.lax.dot_general(
            dy.astype(jnp.bfloat16), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return dx.astype(jnp.bfloat16)
    block = fmt.block_size
    bm = max(16, 1 << (m - 1).bit_length()) if m <= autotune.DECODE_MAX_M else cfg.bm
    bk = max(_pow2_divisor(k, cfg.bk), max(16, block))
    bc = max(16, min(cfg.bc, 1 << (n - 1).bit_length()))
    cfg = dataclasses.replace(cfg, bm=bm, bk=bk, bc=bc)
    out_shape = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    kernel = functools.partial(_bwd_kernel, fmt=fmt, m=m, n=n, k=k, cfg=cfg, decode=decode)
    args = [
        dy.astype(jnp.bfloat16),
        codes,
        _kernel_scales(scales),
        jnp.reshape(gs.astype(jnp.float32), (1,)),
        _table_input(fmt),
    ]
    return _launch(
        kernel,
        args,
        out_shape=out_shape,
        grid=(pl.cdiv(m, bm) * (k // bk),),
        cfg=cfg,
        interpret=interpret,
        poison=poison,
        name=f"w4a16_{fmt.name}_bwd",
    )


# ----------------------------------------------------------------------------- dequantize kernel


def _dequant_kernel(c_ref, s_ref, g_ref, r_ref, t_ref, o_ref, *, fmt, n, k, bn, bk, decode):
    """One [bn, bk] tile of W = table[codes] * scale / global_scale, written as bf16."""
    words = _load_words(t_ref, fmt, decode)
    n0 = pl.program_id(0) * bn
    k0 = pl.program_id(1) * bk
    w0 = r_ref[0] + n0
    rows = n0 + _iota(bn)
    ragged = n % bn != 0
    c, s = _load_w_tile(c_ref, s_ref, w0, k0, bn, bk, fmt, valid=rows < n if ragged else None)
    w = (_decode_tile(c, s, fmt, decode, words).astype(jnp.float32) * (1.0 / g_ref[0])).astype(o_ref.dtype)
    idx = (pl.ds(n0, bn), pl.ds(k0, bk))
    if ragged:
        plgpu.store(o_ref.at[idx], w, mask=jnp.broadcast_to((rows < n)[:, None], (bn, bk)))
    else:
        o_ref[idx] = w


def _dequantize(
    codes,
    scales,
    gs,
    *,
    fmt: KernelFormat,
    interpret: bool,
    decode: str | None = None,
    bn: int = 64,
    bk: int = 256,
    n: int | None = None,
    row0: jax.Array | None = None,
) -> jax.Array:
    """W bf16 [N, K] from the packed arrays (the 'dequant' path: then an XLA dot).

    n / row0: the N rows starting at row0 (int32 [1]) of codes / scales (one layer of a
    stack viewed as [L * N, ...]); default all rows.
    """
    fmt = KernelFormat.of(fmt)
    n = codes.shape[0] if n is None else n
    k = 2 * codes.shape[1]
    row0 = jnp.zeros((1,), jnp.int32) if row0 is None else row0
    decode = {None: "jnp" if interpret else "asm", "bits": "asm"}.get(decode, decode)
    block = fmt.block_size
    bk = max(_pow2_divisor(k, bk), max(16, block))
    kernel = functools.partial(_dequant_kernel, fmt=fmt, n=n, k=k, bn=bn, bk=bk, decode=decode)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, k), jnp.bfloat16),
        grid=(pl.cdiv(n, bn), k // bk),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name=f"w4a16_{fmt.name}_dequant",
    )(codes, _kernel_scales(scales), jnp.reshape(gs.astype(jnp.float32), (1,)), row0, _table_input(fmt))


def dot_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """float32 x [M, K] @ w [N, K].T of bf16 operands, fp32 accumulation (XLA / cuBLAS)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- public API


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _qmm(x, codes, scales, gs, layer, fmt, interpret):
    return forward_launch(x, codes, scales, gs, fmt=fmt, interpret=interpret, layer=layer)


def _qmm_fwd(x, codes, scales, gs, layer, fmt, interpret):
    return _qmm(x, codes, scales, gs, layer, fmt, interpret), (codes, scales, gs, layer)


def _qmm_bwd(fmt, interpret, res, dy):
    codes, scales, gs, layer = res
    if layer is not None:  # the backward kernel takes one matrix: slice the layer out
        codes, scales, gs = (jnp.take(a, layer, axis=0) for a in (codes, scales, jnp.reshape(gs, (-1,))))
    dx = backward_launch(dy, codes, scales, gs, fmt=fmt, interpret=interpret)
    # W is frozen: no cotangent for codes / scales / global scale (nor the layer index).
    return dx, None, None, None, None


_qmm.defvjp(_qmm_fwd, _qmm_bwd)


def _validate_layer(packed: Any, layer: Any) -> Any:
    """For `layer` given: checks the stack and returns a 2-D view of one layer for `_validate`."""
    codes = getattr(packed, "codes", None)
    if codes is None or codes.ndim != 3:
        raise ValueError(
            "with layer=..., packed must be a stack of layers (codes [L, N, K/2]); "
            f"got codes of shape {getattr(codes, 'shape', None)}"
        )
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise TypeError(f"layer must be an integer scalar, got {layer!r}")
    if isinstance(layer, int) and not 0 <= layer < codes.shape[0]:
        raise ValueError(f"layer={layer} out of range for a stack of {codes.shape[0]} layers")
    if tuple(packed.global_scale.shape) not in ((codes.shape[0],), (codes.shape[0], 1)):
        raise ValueError(f"packed.global_scale must have shape ({codes.shape[0]},), got {packed.global_scale.shape}")
    sds = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # noqa: E731
    return dataclasses.replace(
        packed,
        codes=sds(codes),
        scales=sds(packed.scales),
        global_scale=jax.ShapeDtypeStruct((), packed.global_scale.dtype),
    )


def quant_matmul(
    x: jax.Array, packed: Any, *, layer: jax.Array | int | None = None, interpret: bool | None = None
) -> jax.Array:
    """y float32 [M, N] = x bf16 [M, K] @ dequantize(packed).T, fp32 accumulation (unrounded:
    the caller adds its bias / LoRA delta and rounds once).

    packed: a 2-D `PackedWeight` (codes uint8 [N, K/2], scales [N, K/block], scalar
    global_scale) of format "nvfp4", "mxfp4" or "nf4"; or, with `layer` (an int32 scalar,
    may be traced), a stack of L such weights ([L, N, K/2], [L, N, K/block], [L]) of which
    layer `layer` is used, read in place by the kernel (no copy of the slice). Differentiable
    in x (custom VJP, W frozen). interpret: None = Pallas interpreter on CPU, compiled Triton
    on GPU. Raises ValueError / TypeError on bad shapes or dtypes before anything is launched.
    """
    fmt, _, _, _ = _validate(x, packed if layer is None else _validate_layer(packed, layer))
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
    return _qmm(x, packed.codes, packed.scales, packed.global_scale, layer, fmt, _resolve_interpret(interpret))


def nvfp4_matmul(x: jax.Array, packed: Any, *, interpret: bool | None = None) -> jax.Array:
    """`quant_matmul` restricted to NVFP4 weights (E2M1 codes, e4m3 block-16 scales)."""
    fmt, _, _, _ = _validate(x, packed, names=("nvfp4",))
    return _qmm(x, packed.codes, packed.scales, packed.global_scale, None, fmt, _resolve_interpret(interpret))


def dequantize_bf16(packed: Any, *, layer: jax.Array | int | None = None, interpret: bool | None = None) -> jax.Array:
    """bf16 W [N, K] of a packed weight (or of layer `layer` of a stack), by the same kernel
    (and so the same values) as the "dequant" path of `quant_matmul`."""
    fmt, _, n, k = _validate(
        jax.ShapeDtypeStruct((1, 2 * packed.codes.shape[-1]), jnp.bfloat16),
        packed if layer is None else _validate_layer(packed, layer),
    )
    codes, scales, gs, row0 = _select_layer(packed.codes, packed.scales, packed.global_scale, layer)
    return _dequantize(codes, scales, gs, fmt=fmt, interpret=_resolve_interpret(interpret), n=n, row0=row0)
