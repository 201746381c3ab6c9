"""A decode step's projection with its neighbours fused in: one kernel per projection group.

    y = epilogue((x' @ W.T + bf16(s * x' @ A.T) @ B.T) * r + bias)     (float32 inside, bf16 out)

for the few rows of a decode step (at most MAX_ROWS) and a dense bf16 weight W [N, K] whose
adapter's A [R, K] may sit below its rows (`qerl_jax.linear.Fused.lora_rows`), B [N, R]:
- prologue `norm` (a RMSNorm's scale [K]): x is the residual stream h, x' = bf16(scale * h) and
  r = 1/rms(h), both computed here (`qwen2.rms_norm_parts`: the norm in two parts around the
  matmul); without it x' = x and r = 1;
- epilogue "none": bf16(y) [M, N]; "silu_mul": W holds gate and up stacked (N = 2 * n),
  silu(bf16(y_gate)) * bf16(y_up) [M, n]; "residual": bf16(residual + bf16(y)) [M, N].

Why: at a few rows a decode step is a chain of ~18 small kernels a layer, each ~2 us of GPU
time whatever its bytes (H200, Qwen2.5-1.5B LoRA r16: 500 kernels, 2.2 ms of busy GPU a step;
benchmarks/KERNEL_NOTES.md). XLA gives the norm, the adapter's second matmul, SiLU x up and the
residual add a kernel each; here they ride on the weight stream. Every program recomputes the
row norms and x' @ A.T for its own tile (a few KB of x and R x K of A, read from L2), so no
program waits for another.

Each program owns BN output columns (with "silu_mul", the same BN of gate and of up) and walks
K in BK steps: x' [16, BK] (rows past M masked to 0) against the W tile on tensor cores. One
grid axis, no split-K: the columns are narrowed until the programs fill the GPU (`block_n`).
`decode_linear_reference` is the same computation in jnp, for tests and for the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

EPILOGUES = ("none", "silu_mul", "residual")
MAX_ROWS = 16  # one tensor-core tile of rows
# The model runs a projection group here only when its weight is at most this size. Measured
# (H200, Qwen2.5-1.5B shapes, rows 1 and 16, `benchmarks/devtools/decode_linear_probe.py --sweep`):
# q/k/v (6.4 MB) 12.4-13.2 us against XLA's chain's 13.5-16.2, o_proj (4.7 MB) 8.3-8.8 against
# 17.9-18.6; gate/up (55 MB) 33-35 us against 26.5-27.5 and down (27.5 MB) 25-26 against
# 19-25: on large weights this kernel streams at 23-35% of the memory limit, below XLA's GEMMs.
MAX_WEIGHT_BYTES = 16 * 2**20
_BM = 16
_MIN_PROGRAMS = 96  # narrower column tiles until this many programs stream the weight (132 SMs)


# ----------------------------------------------------------------------------- reference


def decode_linear_reference(
    x_MxK, w_NxK, *, n, lora_b_NxR=None, lora_scale=1.0, bias_N=None, norm_K=None, eps=1e-6,
    epilogue="none", residual_MxN=None,
):  # fmt: skip
    """The kernel's computation in jnp (float32 accumulation, the same roundings). n: W's rows
    of projections (sum of the fused sizes); rows n: of W are the adapters' A."""
    x32 = x_MxK.astype(jnp.float32)
    if norm_K is not None:
        r_Mx1 = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        xs = (norm_K.astype(jnp.float32) * x32).astype(jnp.bfloat16)
    else:
        r_Mx1, xs = None, x_MxK.astype(jnp.bfloat16)
    dot = functools.partial(jnp.einsum, "mk,nk->mn", preferred_element_type=jnp.float32)
    y = dot(xs, w_NxK[:n].astype(jnp.bfloat16))
    if lora_b_NxR is not None:
        h = dot(xs, w_NxK[n:].astype(jnp.bfloat16))
        y = y + dot((lora_scale * h).astype(jnp.bfloat16), lora_b_NxR.astype(jnp.bfloat16))
    if r_Mx1 is not None:
        y = y * r_Mx1
    if bias_N is not None:
        y = y + bias_N.astype(jnp.float32)
    y = y.astype(jnp.bfloat16)
    if epilogue == "silu_mul":
        g, u = y[:, : n // 2].astype(jnp.float32), y[:, n // 2 :].astype(jnp.float32)
        return (g * jax.nn.sigmoid(g) * u).astype(jnp.bfloat16)
    if epilogue == "residual":
        return (residual_MxN.astype(jnp.float32) + y.astype(jnp.float32)).astype(jnp.bfloat16)
    return y


# ----------------------------------------------------------------------------- kernel


def _iota(n: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [P, K] @ b [Q, K].T, float32 accumulation on tensor cores."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _load(ref, idx, mask):
    return ref[idx] if mask is None else plgpu.load(ref.at[idx], mask=mask, other=0)


def _kernel(*refs, m, k, n, n_out, lora_rows, r_pad, bn, bk, eps, lora_scale, epilogue, has_bias, has_norm, h_in):
    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    b_ref = next(it) if lora_rows else None
    h_ref = next(it) if h_in else None
    bias_ref = next(it) if has_bias else None
    norm_ref = next(it) if has_norm else None
    res_ref = next(it) if epilogue == "residual" else None
    o_ref = refs[-1]  # after an optional poisoned input aliased to it

    # Tiles may reach past an array's end (16 rows of an M-row x, R rows of A padded to a power
    # of two): masked, they read nothing there. A traced start keeps Pallas' static bounds
    # check, written for unmasked blocks, off them.
    zero = pl.program_id(0) * 0
    n0 = pl.program_id(0) * bn
    rows = _iota(_BM)
    cols = n0 + _iota(bn)
    row_ok = rows < m
    col_ok = cols < n_out
    row_mask = None if m == _BM else row_ok
    col_mask = None if n_out % bn == 0 else col_ok
    a_ok = _iota(r_pad) < lora_rows
    steps = pl.cdiv(k, bk)

    def tile_mask(height_ok, k0, height):
        """[height, bk] mask of the rows height_ok (None: all) and the columns k0.. inside K."""
        k_ok = None if k % bk == 0 else (k0 + _iota(bk)) < k
        if height_ok is None and k_ok is None:
            return None
        if k_ok is None:
            return jnp.broadcast_to(height_ok[:, None], (height, bk))
        if height_ok is None:
            return jnp.broadcast_to(k_ok[None, :], (height, bk))
        return height_ok[:, None] & k_ok[None, :]

    def x_tile(k0):
        return _load(x_ref, (pl.ds(zero, _BM), pl.ds(k0, bk)), tile_mask(row_mask, k0, _BM))

    def w_tile(first_row, height_ok, k0, height):
        return _load(w_ref, (pl.ds(first_row, height), pl.ds(k0, bk)), tile_mask(height_ok, k0, height))

    inv_rms = None
    if has_norm:

        def sumsq(i, acc):
            x = x_tile(pl.multiple_of(i * bk, bk)).astype(jnp.float32)
            return acc + jnp.sum(x * x, axis=1)

        ss = jax.lax.fori_loop(0, steps, sumsq, jnp.zeros((_BM,), jnp.float32))
        inv_rms = jax.lax.rsqrt(ss / k + eps)

    halves = (0, n_out) if epilogue == "silu_mul" else (0,)

    def body(i, carry):
        accs, h = carry
        k0 = pl.multiple_of(i * bk, bk)
        x = x_tile(k0)
        if has_norm:
            k_ok = None if k % bk == 0 else (k0 + _iota(bk)) < k
            scale = _load(norm_ref, (pl.ds(k0, bk),), k_ok).astype(jnp.float32)
            x = (x.astype(jnp.float32) * scale[None, :]).astype(jnp.bfloat16)
        x = x.astype(jnp.bfloat16)
        accs = tuple(acc + _dot_nt(x, w_tile(off + n0, col_mask, k0, bn)) for acc, off in zip(accs, halves))
        if lora_rows and not h_in:
            h = h + _dot_nt(x, w_tile(n + zero, a_ok, k0, r_pad))
        return accs, h

    zeros = tuple(jnp.zeros((_BM, bn), jnp.float32) for _ in halves)
    accs, h = jax.lax.fori_loop(0, steps, body, (zeros, jnp.zeros((_BM, r_pad), jnp.float32)))
    if h_in:  # x' @ A.T from the caller
        h_mask = jnp.broadcast_to((row_ok if row_mask is not None else rows >= 0)[:, None] & a_ok[None, :], (_BM, r_pad))
        h = _load(h_ref, (pl.ds(zero, _BM), pl.ds(zero, r_pad)), h_mask)

    outs = []
    for acc, off in zip(accs, halves):
        if lora_rows:
            hb = (lora_scale * h).astype(jnp.bfloat16)
            b_mask = a_ok[None, :] if col_mask is None else col_ok[:, None] & a_ok[None, :]
            b = _load(b_ref, (pl.ds(off + n0, bn), pl.ds(zero, r_pad)), jnp.broadcast_to(b_mask, (bn, r_pad)))
            acc = acc + _dot_nt(hb, b)
        if has_norm:
            acc = acc * inv_rms[:, None]
        if has_bias:
            acc = acc + _load(bias_ref, (pl.ds(off + n0, bn),), col_mask).astype(jnp.float32)[None, :]
        outs.append(acc.astype(jnp.bfloat16).astype(jnp.float32))
    out_mask = None
    if row_mask is not None or col_mask is not None:
        out_mask = jnp.broadcast_to(row_ok[:, None] & col_ok[None, :], (_BM, bn))
    if epilogue == "silu_mul":
        g, u = outs
        out = g * (1.0 / (1.0 + jnp.exp(-g))) * u
    elif epilogue == "residual":
        out = outs[0] + _load(res_ref, (pl.ds(zero, _BM), pl.ds(n0, bn)), out_mask).astype(jnp.float32)
    else:
        out = outs[0]
    idx = (pl.ds(zero, _BM), pl.ds(n0, bn))
    if out_mask is None:
        o_ref[idx] = out.astype(o_ref.dtype)
    else:
        plgpu.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=out_mask)


# ----------------------------------------------------------------------------- wrapper


def block_n(n_out: int, cap: int = 64) -> int:
    """Output columns per program: the widest power of two <= cap (at least 16, the tensor-core
    tile) that still gives _MIN_PROGRAMS programs, so that enough SMs stream the weight."""
    bn = cap
    while bn > 16 and pl.cdiv(n_out, bn) < _MIN_PROGRAMS:
        bn //= 2
    return bn


def _pow2_at_least(x: int, floor: int) -> int:
    p = floor
    while p < x:
        p *= 2
    return p


def decode_linear(
    x_MxK: jax.Array,
    w_NxK: jax.Array,
    *,
    n: int,
    lora_b_NxR: jax.Array | None = None,
    lora_scale: float = 1.0,
    bias_N: jax.Array | None = None,
    norm_K: jax.Array | None = None,
    eps: float = 1e-6,
    epilogue: str = "none",
    residual_MxN: jax.Array | None = None,
    lora_down: str = "xla",
    bk: int = 256,
    bn: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool | None = None,
    poison: bool = False,
) -> jax.Array:
    """See the module doc. x [M, K] (M <= MAX_ROWS), W [n + R, K] bf16 with the adapters' A below
    row n when lora_b_NxR [n, R] is given, bias float32-castable [n], norm [K], residual [M, N].
    Returns bf16 [M, n] ([M, n / 2] for "silu_mul"). lora_down "kernel": every program computes
    x' @ A.T itself (A read once per program, from L2); "xla": one XLA reduction computes it for
    all (a kernel more, A read once). interpret None: the Pallas interpreter on CPU."""
    m, k = x_MxK.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"decode_linear takes 1..{MAX_ROWS} rows; got {m}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}; got {epilogue!r}")
    if w_NxK.ndim != 2 or w_NxK.shape[1] != k:
        raise ValueError(f"W must be [N, {k}] for x [{m}, {k}]; got {w_NxK.shape}")
    lora_rows = 0 if lora_b_NxR is None else int(lora_b_NxR.shape[1])
    if w_NxK.shape[0] != n + lora_rows:
        raise ValueError(f"W has {w_NxK.shape[0]} rows; expected n + R = {n} + {lora_rows}")
    if lora_b_NxR is not None and lora_b_NxR.shape[0] != n:
        raise ValueError(f"LoRA B must be [{n}, R]; got {lora_b_NxR.shape}")
    if epilogue == "silu_mul" and n % 2:
        raise ValueError(f"silu_mul needs gate and up of equal width; got n = {n}")
    if lora_down not in ("kernel", "xla"):
        raise ValueError(f"lora_down must be 'kernel' or 'xla'; got {lora_down!r}")
    n_out = n // 2 if epilogue == "silu_mul" else n
    if epilogue == "residual" and (residual_MxN is None or residual_MxN.shape != (m, n_out)):
        got = None if residual_MxN is None else residual_MxN.shape
        raise ValueError(f"the residual epilogue needs a residual [{m}, {n_out}]; got {got}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    bn = bn or block_n(n_out)
    bk = min(bk, _pow2_at_least(k, 16))
    r_pad = _pow2_at_least(lora_rows, 16) if lora_rows else 16
    h_in = bool(lora_rows) and lora_down == "xla"
    h = None
    if h_in:
        xs = x_MxK if norm_K is None else norm_K.astype(jnp.float32) * x_MxK.astype(jnp.float32)
        h = _lora_down(xs.astype(jnp.bfloat16), w_NxK[n:])
    args = [
        x_MxK.astype(jnp.bfloat16),
        w_NxK.astype(jnp.bfloat16),
        *([lora_b_NxR.astype(jnp.bfloat16)] if lora_rows else []),
        *([h] if h_in else []),
        *([bias_N.astype(jnp.float32)] if bias_N is not None else []),
        *([norm_K.astype(jnp.float32)] if norm_K is not None else []),
        *([residual_MxN.astype(jnp.bfloat16)] if epilogue == "residual" else []),
    ]
    tiles = pl.cdiv(n_out, bn)
    out_rows, out_cols = m, n_out
    if interpret:  # the interpreter slices tiles like unmasked blocks: pad every array to whole tiles
        out_rows, out_cols = _BM, tiles * bn
        args = _padded_for_interpreter(
            args, epilogue=epilogue, has_lora=bool(lora_rows), h_in=h_in, has_bias=bias_N is not None,
            has_norm=norm_K is not None, k=k, n=n, n_out=n_out, tiles=tiles, bn=bn, bk=bk, r_pad=r_pad,
        )  # fmt: skip
    out_shape = jax.ShapeDtypeStruct((out_rows, out_cols), jnp.bfloat16)
    aliases = {}
    if poison:
        args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        aliases = {len(args) - 1: 0}
    kernel = functools.partial(
        _kernel, m=m, k=k, n=n, n_out=n_out, lora_rows=lora_rows, r_pad=r_pad, bn=bn, bk=bk, eps=eps,
        lora_scale=float(lora_scale), epilogue=epilogue, has_bias=bias_N is not None, has_norm=norm_K is not None,
        h_in=h_in,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(tiles,),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"decode_linear_{epilogue}",
    )(*args)
    return out[:m, :n_out]


def _lora_down(xs_MxK: jax.Array, a_RxK: jax.Array) -> jax.Array:
    """float32 x' @ A.T [M, R] as a multiply-reduce (one XLA reduction kernel at a few rows)."""
    return jnp.sum(xs_MxK.astype(jnp.float32)[:, None, :] * a_RxK.astype(jnp.float32)[None], axis=-1)


def _padded_for_interpreter(args, *, epilogue, has_lora, h_in, has_bias, has_norm, k, n, n_out, tiles, bn, bk, r_pad):
    """args (x, W, [B], [bias], [norm], [residual]) zero-padded so that every tile the kernel
    reads lies inside its array (on the GPU the masks alone keep reads inside)."""
    halves = 2 if epilogue == "silu_mul" else 1
    col_end = (halves - 1) * n_out + tiles * bn  # the last column tile's end, in W's rows
    kp = pl.cdiv(k, bk) * bk

    def pad(a, *shape):
        return jnp.pad(a, [(0, max(0, want - have)) for want, have in zip(shape, a.shape, strict=True)])

    it = iter(args)
    out = [pad(next(it), _BM, kp), pad(next(it), max(col_end, n + r_pad), kp)]
    if has_lora:
        out.append(pad(next(it), col_end, r_pad))
    if h_in:
        out.append(pad(next(it), _BM, r_pad))
    if has_bias:
        out.append(pad(next(it), col_end))
    if has_norm:
        out.append(pad(next(it), kp))
    if epilogue == "residual":
        out.append(pad(next(it), _BM, tiles * bn))
    return out
