"""Length-aware decode attention in Pallas (Triton lowering): one query per row, read only the
cache slots the row has written.

    out [B, H, D] = softmax(q [B, H, D] . k[b, start_b:end_b].T * D**-0.5) @ v[b, start_b:end_b]

q's H heads share the cache's KVH = H / G heads in groups of G contiguous heads (query head h
uses KV head h // G, as the model's `q.reshape(b, t, kvh, g, d)`). Scores and softmax are in
float32; the K / V tiles are cast to q's dtype and the softmax weights to it before the PV
product, as `qerl_jax.models.qwen2.attention` does.

Kernel (`_kernel`, grid (B, KVH, num_splits)): a program loads the G query heads of its KV head
once as a [G_pad, D] tile (G padded to a power of two >= 16, a Triton dot's smallest M; the
padding rows are masked) and walks its share of the row's blocks of `block_s` slots: one
[block_s, D] K tile and one V tile per step serve all G heads (two tensor-core dots), with an
online softmax (running max, sum and accumulator in float32). The loop bounds come from start /
end (scalar loads), so blocks outside [start, end) are never visited; inside the first and last
block the loads are masked by slot index, so slots outside [start, end) are never read (they may
hold anything, NaN included). With num_splits > 1 (flash-decoding, for small B: B * KVH programs
alone cannot fill 132 SMs) split s takes the s-th contiguous share of the row's blocks and writes
a partial (max, sum, accumulator); `_combine` (jnp) merges them. A row with end <= start
(inactive) gives zeros.

Bytes a call must move (what `bytes_moved` returns, the base of a bandwidth figure):
the valid K and V slots once, sum_b (end_b - start_b) * KVH * D * 2 * itemsize(cache), plus
q and the output (B * H * D * itemsize(q) each). FLOPs: 4 * H * D per valid slot per row
(q.k and p.v; the G padding is not counted).

`default_num_splits` is the rule for num_splits (tuning key "num_splits"); the other tuning
keys are block_s, num_warps and num_stages. `interpret=None` runs the Pallas interpreter when
the default backend is CPU, the compiled Triton kernel otherwise. The same function in plain jnp
(a masked softmax over the whole cache), the XLA path and this kernel's reference, is the model's
`qerl_jax.models.qwen2.decode_attention_reference`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.autotune import NUM_SMS

_NEG = -1e30  # finite "minus infinity" for the running max: no inf - inf = NaN anywhere
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_MIN_DOT_ROWS = 16  # Triton's smallest dot tile
DEFAULT_BLOCK_S = 64
MIN_BLOCKS_PER_SPLIT = 2
MAX_SPLITS = 32
TUNING_KEYS = ("num_splits", "block_s", "num_warps", "num_stages")


def default_num_splits(batch: int, kv_heads: int, seq_len: int, block_s: int = DEFAULT_BLOCK_S) -> int:
    """Splits per (row, KV head): enough programs for one per SM (ceil(NUM_SMS / (B * KVH))),
    but at least MIN_BLOCKS_PER_SPLIT blocks of the longest possible row (the cache length S;
    row lengths are traced values) per split, and at most MAX_SPLITS. B * KVH >= NUM_SMS: 1."""
    want = -(-NUM_SMS // max(1, batch * kv_heads))
    blocks = -(-seq_len // block_s)
    return int(max(1, min(want, blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)))


def bytes_moved(q_BxHxD: Any, k_BxSxKxD: Any, start_B: Any, end_B: Any) -> int:
    """Bytes a call must move (module docstring): valid K and V slots once, q and the output."""
    b, s, kv_heads, d = k_BxSxKxD.shape
    start = np.clip(np.asarray(start_B, np.int64), 0, s)
    end = np.clip(np.asarray(end_B, np.int64), 0, s)
    slots = int(np.maximum(end - start, 0).sum())
    kv = 2 * slots * kv_heads * d * jnp.dtype(k_BxSxKxD.dtype).itemsize
    return kv + 2 * int(np.prod(q_BxHxD.shape)) * jnp.dtype(q_BxHxD.dtype).itemsize


# ----------------------------------------------------------------------------- validation


def _resolve_interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _validate(q, k, v, start, end) -> tuple[int, int, int, int, int]:
    """Checks shapes and dtypes before anything is traced; returns (B, H, S, KVH, D)."""
    for name, x, ndim in (("q_BxHxD", q, 3), ("k_BxSxKxD", k, 4), ("v_BxSxKxD", v, 4), ("start_B", start, 1)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if not hasattr(end, "shape") or tuple(end.shape) != tuple(start.shape):
        raise ValueError(f"end_B must have start_B's shape {tuple(start.shape)}, got {getattr(end, 'shape', end)}")
    b, h, d = q.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v_BxSxKxD shape {tuple(v.shape)} != k_BxSxKxD shape {tuple(k.shape)}")
    kb, s, kv_heads, kd = k.shape
    if kb != b or kd != d:
        raise ValueError(f"q_BxHxD {tuple(q.shape)} and k_BxSxKxD {tuple(k.shape)} disagree on B or D")
    if start.shape[0] != b:
        raise ValueError(f"start_B / end_B must have shape ({b},), got {tuple(start.shape)}")
    if kv_heads == 0 or h % kv_heads:
        raise ValueError(f"query heads H={h} must be a multiple of the KV heads KVH={kv_heads}")
    for name, x in (("q_BxHxD", q), ("k_BxSxKxD", k), ("v_BxSxKxD", v)):
        if jnp.dtype(x.dtype) not in _DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    for name, x in (("start_B", start), ("end_B", end)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    return b, h, s, kv_heads, d


def _tuning(batch: int, kv_heads: int, seq_len: int, tuning: dict) -> dict:
    unknown = set(tuning) - set(TUNING_KEYS)
    if unknown:
        raise ValueError(f"unknown tuning keys {sorted(unknown)}; expected some of {TUNING_KEYS}")
    block_s = int(tuning.get("block_s", DEFAULT_BLOCK_S))
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two >= 16, got {block_s}")
    num_splits = tuning.get("num_splits")
    num_splits = default_num_splits(batch, kv_heads, seq_len, block_s) if num_splits is None else int(num_splits)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_warps, num_stages = int(tuning.get("num_warps", 4)), int(tuning.get("num_stages", 2))
    return dict(block_s=block_s, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- kernel


def _iota(n: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, start_ref, end_ref, *out_refs, g, g_pad, block_s, num_splits, seq_len):
    """One (row b, KV head h, split) program. q_ref [B, KVH, G, D]; k_ref / v_ref [B, S, KVH, D];
    out_refs: (o_ref [B, KVH, G, D],) or the partials (m_ref, l_ref [B, KVH, NS, G_pad], acc_ref
    [B, KVH, NS, G_pad, D]), each possibly preceded by its NaN-filled aliased input.

    Long because a Pallas kernel body is one traced program: its loop carries and refs are shared
    by every part, so it reads best as the one online-softmax loop it is."""
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = q_ref.shape[-1]
    cdt = q_ref.dtype
    start = jnp.maximum(start_ref[b], 0)
    end = jnp.minimum(end_ref[b], seq_len)
    end = jnp.maximum(end, start)
    # Block range of the row, then this split's contiguous share (all values >= 0: lax.div).
    first = jax.lax.div(start, block_s)
    count = jnp.where(end > start, jax.lax.div(end + block_s - 1, block_s) - first, 0)
    per = jax.lax.div(count + num_splits - 1, num_splits)
    lo = first + jnp.minimum(split * per, count)
    hi = first + jnp.minimum(split * per + per, count)

    head_ok = _iota(g_pad) < g
    q_mask = None if g_pad == g else jnp.broadcast_to(head_ok[:, None], (g_pad, d))
    q_idx = q_ref.at[b, h, pl.ds(0, g_pad), :]
    q = q_idx[...] if q_mask is None else plgpu.load(q_idx, mask=q_mask, other=0)
    scale = d**-0.5

    def body(i, carry):
        m, total, acc = carry
        s0 = pl.multiple_of(i * block_s, block_s)
        slots = s0 + _iota(block_s)
        valid = (slots >= start) & (slots < end)
        kv_mask = jnp.broadcast_to(valid[:, None], (block_s, d))
        kt = plgpu.load(k_ref.at[b, pl.ds(s0, block_s), h, :], mask=kv_mask, other=0).astype(cdt)
        vt = plgpu.load(v_ref.at[b, pl.ds(s0, block_s), h, :], mask=kv_mask, other=0).astype(cdt)
        scores = _dot(q, kt, contract=(1, 1)) * scale  # [G_pad, block_s]
        scores = jnp.where(valid[None, :], scores, _NEG)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])
        total = total * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(cdt), vt, contract=(1, 0))
        return m_new, total, acc

    init = (
        jnp.full((g_pad,), _NEG, jnp.float32),
        jnp.zeros((g_pad,), jnp.float32),
        jnp.zeros((g_pad, d), jnp.float32),
    )
    m, total, acc = jax.lax.fori_loop(lo, hi, body, init)

    if num_splits == 1:
        o_ref = out_refs[-1]
        inv = jnp.where(total > 0, 1.0 / jnp.maximum(total, 1e-30), 0.0)  # inactive row: zeros
        out = (acc * inv[:, None]).astype(o_ref.dtype)
        o_idx = o_ref.at[b, h, pl.ds(0, g_pad), :]
        if q_mask is None:
            o_idx[...] = out
        else:
            plgpu.store(o_idx, out, mask=q_mask)
        return
    m_ref, l_ref, acc_ref = out_refs[-3:]
    m_ref[b, h, split, :] = m
    l_ref[b, h, split, :] = total
    acc_ref[b, h, split, :, :] = acc


def _combine(m, total, acc, g: int) -> jax.Array:
    """Merges the splits' partials: m, total [B, KVH, NS, G_pad], acc [.., G_pad, D] -> [B, KVH, G, D] f32."""
    m, total, acc = m[..., :g], total[..., :g], acc[..., :g, :]
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # empty splits: m = _NEG -> 0 (or 1 if all empty)
    total = jnp.sum(weight * total, axis=2)
    acc = jnp.sum(weight[..., None] * acc, axis=2)
    inv = jnp.where(total > 0, 1.0 / jnp.maximum(total, 1e-30), 0.0)
    return acc * inv[..., None]


def _decode_attention(q, k, v, start, end, *, interpret: bool, poison: bool = False, **tuning) -> jax.Array:
    """The launch (validated arguments); `poison` NaN-fills every kernel output buffer first."""
    b, h, s, kv_heads, d = k.shape[0], q.shape[1], k.shape[1], k.shape[2], k.shape[3]
    g = h // kv_heads
    g_pad = max(_MIN_DOT_ROWS, 1 << (g - 1).bit_length())
    cfg = _tuning(b, kv_heads, s, tuning)
    if b == 0 or s == 0:  # no program to launch (every row is inactive)
        return jnp.zeros(q.shape, q.dtype)
    ns = cfg["num_splits"]
    if ns == 1:
        out_shape = [jax.ShapeDtypeStruct((b, kv_heads, g, d), q.dtype)]
    else:
        part = (b, kv_heads, ns, g_pad)
        out_shape = [jax.ShapeDtypeStruct(part, jnp.float32)] * 2 + [jax.ShapeDtypeStruct((*part, d), jnp.float32)]
    args = [
        q.reshape(b, kv_heads, g, d),
        k,
        v,
        jnp.asarray(start, jnp.int32),
        jnp.asarray(end, jnp.int32),
    ]
    aliases = {}
    if poison:
        aliases = {len(args) + i: i for i in range(len(out_shape))}
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    kernel = functools.partial(_kernel, g=g, g_pad=g_pad, block_s=cfg["block_s"], num_splits=ns, seq_len=s)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, kv_heads, ns),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name="decode_attention",
    )(*args)
    out = outs[0] if ns == 1 else _combine(*outs, g=g).astype(q.dtype)
    return out.reshape(b, h, d)


# ----------------------------------------------------------------------------- public API


def decode_attention(
    q_BxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    start_B: jax.Array,
    end_B: jax.Array,
    *,
    interpret: bool | None = None,
    **tuning: Any,
) -> jax.Array:
    """One decode query per row against its own cache slots [start_B[b], end_B[b]).

    q [B, H, D] (bf16 or f32), k/v cache [B, S, KVH, D] (bf16 or f32), H = KVH * G; query head h
    uses KV head h // G (heads of one KV head are contiguous, as the model's q.reshape(b, t, kvh,
    g, d)). start_B/end_B int32 [B]: 0 <= start <= end <= S (values outside are clamped). Scores
    q.k * D**-0.5 and the softmax in float32. Returns [B, H, D] in q's dtype; a row with end <=
    start (an inactive row) gives zeros, never NaN. Slots outside [start, end) are never read
    (whole blocks outside are skipped). tuning: num_splits (default `default_num_splits`), block_s
    (64), num_warps (4), num_stages (2). interpret: None = Pallas interpreter on CPU.
    """
    _validate(q_BxHxD, k_BxSxKxD, v_BxSxKxD, start_B, end_B)
    return _decode_attention(
        q_BxHxD, k_BxSxKxD, v_BxSxKxD, start_B, end_B, interpret=_resolve_interpret(interpret), **tuning
    )
