"""Length-aware decode attention (pallas_kernels/decode_attention.py) in interpret mode on CPU.

The kernel and its jnp reference (the model's XLA path, `qwen2.decode_attention_reference`) are
checked against a float64 numpy computation written here (softmax over each row's slots
[start, end) only) on fresh random inputs: ragged rows (left
padding, a row ending at the cache end, a row of length 1, an inactive row), GQA groups of 1, 3
and 7 heads, D in {64, 128}, bf16 and f32, several num_splits and block sizes. The kernel's
output buffers are NaN-filled first, so any element it fails to write shows. Slots outside
[start, end) are filled with NaN (kernel) or huge values (reference) and must not change the
output. The reference is also checked against the model's full-cache `attention` with the
equivalent mask, and the kernel is lowered for CUDA (Triton IR) to check that the lowering
accepts its dynamic loop.
"""

from __future__ import annotations

import functools
import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from qerl_jax.models import qwen2

# The module (the package's `decode_attention` attribute is the function of the same name).
da = importlib.import_module("pallas_kernels.decode_attention")

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}  # relative Frobenius error of the output


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def ragged_rows(s: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) per row: full cache, left-padded to the cache end, length 1, inactive,
    a ragged interior range, a range ending just before the end."""
    start = np.array([0, s // 2 - 3, 20, 33, 5, 1], np.int32)
    end = np.array([s, s, 21, 33, s - 19, s - 1], np.int32)
    return start, end


def rand_inputs(rng, b: int, s: int, kv_heads: int, g: int, d: int, dtype):
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 1.5).astype(dtype)

    return normal(b, kv_heads * g, d), normal(b, s, kv_heads, d), normal(b, s, kv_heads, d)


def numpy_reference(q, k, v, start, end) -> np.ndarray:
    """float64 attention of each query head over its row's slots [start, end) only; zeros if empty."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    b, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, h, d))
    for row in range(b):
        lo, hi = int(start[row]), int(end[row])
        if hi <= lo:
            continue
        for head in range(h):
            scores = k[row, lo:hi, head // g] @ q[row, head] * d**-0.5
            w = np.exp(scores - scores.max())
            out[row, head] = (w / w.sum()) @ v[row, lo:hi, head // g]
    return out


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "output has NaN/inf (an unwritten element or a read of a masked slot)"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def kernel(q, k, v, start, end, **tuning):
    return da._decode_attention(q, k, v, jnp.asarray(start), jnp.asarray(end), interpret=True, poison=True, **tuning)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("g,d", [(1, 64), (3, 128), (7, 64), (7, 128)])
def test_kernel_matches_float64_reference(g, d, dtype):
    s, kv_heads = 80, 2  # S is not a multiple of block_s = 32: the last block runs past the cache
    start, end = ragged_rows(s)
    q, k, v = rand_inputs(_rng("ragged", g, d, str(dtype)), len(start), s, kv_heads, g, d, dtype)
    ref = numpy_reference(q, k, v, start, end)
    assert rel_err(qwen2.decode_attention_reference(q, k, v, jnp.asarray(start), jnp.asarray(end)), ref) < TOL[dtype]
    for num_splits in (1, 3):
        out = kernel(q, k, v, start, end, num_splits=num_splits, block_s=32)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert rel_err(out, ref) < TOL[dtype], num_splits
        np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # the inactive row


@pytest.mark.parametrize("num_splits,block_s", [(1, 16), (2, 16), (4, 16), (7, 32), (12, 16), (1, 128)])
def test_kernel_splits_and_block_sizes(num_splits, block_s):
    """More splits than a row has blocks (empty splits), S = 75 not a multiple of 16, mixed
    dtypes (f32 query, bf16 cache)."""
    s, kv_heads, g, d = 75, 3, 3, 64
    start, end = ragged_rows(s)
    rng = _rng("splits", num_splits, block_s)
    q, k, v = rand_inputs(rng, len(start), s, kv_heads, g, d, jnp.float32)
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    out = kernel(q, k, v, start, end, num_splits=num_splits, block_s=block_s)
    assert out.dtype == jnp.float32
    assert rel_err(out, numpy_reference(q, k, v, start, end)) < TOL[jnp.float32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_slots_outside_rows_are_not_read(dtype):
    """NaN in every slot outside [start, end) leaves the kernel's output unchanged (bit for bit)
    and finite; for the reference (which reads every slot) huge finite values do."""
    s, kv_heads, g, d = 96, 2, 7, 64
    start, end = ragged_rows(s)
    q, k, v = rand_inputs(_rng("nan", str(dtype)), len(start), s, kv_heads, g, d, dtype)
    slots = np.arange(s)
    outside = jnp.asarray((slots < start[:, None]) | (slots >= end[:, None]))[:, :, None, None]
    nan_k, nan_v = (jnp.where(outside, jnp.nan, x).astype(dtype) for x in (k, v))
    big_k, big_v = (jnp.where(outside, 1e30, x).astype(dtype) for x in (k, v))
    for num_splits in (1, 4):
        clean = kernel(q, k, v, start, end, num_splits=num_splits, block_s=16)
        dirty = kernel(q, nan_k, nan_v, start, end, num_splits=num_splits, block_s=16)
        assert np.isfinite(np.asarray(dirty, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(dirty, np.float32), np.asarray(clean, np.float32))
    ref = functools.partial(qwen2.decode_attention_reference, start_B=jnp.asarray(start), end_B=jnp.asarray(end))
    np.testing.assert_array_equal(np.asarray(ref(q, big_k, big_v), np.float32), np.asarray(ref(q, k, v), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_reference_matches_model_attention(dtype):
    """decode_attention_reference == qwen2.attention on the full cache with the [start, end) mask
    (active rows: the model gives a fully masked row a uniform softmax, the reference zeros)."""
    s, kv_heads, g, d = 48, 2, 7, 128
    start, end = ragged_rows(s)
    q, k, v = rand_inputs(_rng("model", str(dtype)), len(start), s, kv_heads, g, d, dtype)
    slots = np.arange(s)
    mask_BxTxS = jnp.asarray((slots >= start[:, None]) & (slots < end[:, None]))[:, None, :]
    model = qwen2.attention(q[:, None], k, v, mask_BxTxS)[:, 0]
    ours = qwen2.decode_attention_reference(q, k, v, jnp.asarray(start), jnp.asarray(end))
    active = end > start
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(ours[active], np.float32), np.asarray(model[active], np.float32), rtol=tol, atol=tol
    )
    np.testing.assert_array_equal(np.asarray(ours[~active], np.float32), 0.0)


def test_public_api_interprets_on_cpu():
    """pallas_kernels.decode_attention with interpret=None runs the interpreter on CPU; values
    outside [0, S] are clamped."""
    s, kv_heads, g, d = 40, 1, 5, 64
    start = np.array([0, 7, -3], np.int32)
    end = np.array([40, 29, 99], np.int32)
    q, k, v = rand_inputs(_rng("public"), 3, s, kv_heads, g, d, jnp.bfloat16)
    out = pallas_kernels.decode_attention(q, k, v, jnp.asarray(start), jnp.asarray(end))
    clamped_start, clamped_end = np.clip(start, 0, s), np.clip(end, 0, s)
    ref = numpy_reference(q, k, v, clamped_start, clamped_end)
    assert rel_err(out, ref) < TOL[jnp.bfloat16]
    assert rel_err(qwen2.decode_attention_reference(q, k, v, start, end), ref) < TOL[jnp.bfloat16]


def test_empty_cache_gives_zeros():
    q = jnp.ones((2, 6, 64), jnp.bfloat16)
    k = jnp.zeros((2, 0, 2, 64), jnp.bfloat16)
    zeros = jnp.zeros((2,), jnp.int32)
    out = pallas_kernels.decode_attention(q, k, k, zeros, zeros, interpret=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.zeros((2, 6, 64)))


def test_default_num_splits_rule():
    # Qwen2.5-7B (KVH 4): B = 1 splits a 2304-slot cache into 18 (2 blocks of 64 each), B = 16
    # into ceil(132 / 64) = 3; from B * KVH >= 132 programs, no split.
    assert da.default_num_splits(1, 4, 2304) == 18
    assert da.default_num_splits(16, 4, 2304) == 3
    assert da.default_num_splits(64, 4, 2304) == 1
    assert da.default_num_splits(1, 4, 100) == 1  # 2 blocks: one split of 2 blocks
    assert da.default_num_splits(1, 1, 100_000) == da.MAX_SPLITS


def test_bytes_moved():
    q = jax.ShapeDtypeStruct((2, 28, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 100, 4, 128), jnp.bfloat16)
    slots = (100 - 10) + (5 - 0)
    assert da.bytes_moved(q, k, [10, 0], [120, 5]) == 2 * slots * 4 * 128 * 2 + 2 * 2 * 28 * 128 * 2


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q=(2, 7, 64)), ValueError, "multiple of the KV heads"),
        (dict(q=(3, 8, 64)), ValueError, "disagree on B or D"),
        (dict(v=(2, 10, 2, 32)), ValueError, "v_BxSxKxD shape"),
        (dict(start=(3,)), ValueError, "start_B / end_B"),
        (dict(q_dtype=jnp.float16), TypeError, "bfloat16 or float32"),
        (dict(tuning=dict(splits=2)), ValueError, "unknown tuning keys"),
        (dict(tuning=dict(block_s=48)), ValueError, "power of two"),
        (dict(tuning=dict(num_splits=0)), ValueError, "num_splits"),
    ],
)
def test_bad_input_is_rejected(change, error, match):
    q = jnp.zeros(change.get("q", (2, 8, 64)), change.get("q_dtype", jnp.bfloat16))
    k = jnp.zeros((2, 10, 2, 64), jnp.bfloat16)
    v = jnp.zeros(change.get("v", (2, 10, 2, 64)), jnp.bfloat16)
    start = jnp.zeros(change.get("start", (2,)), jnp.int32)
    end = jnp.zeros(change.get("start", (2,)), jnp.int32)
    with pytest.raises(error, match=match):
        pallas_kernels.decode_attention(q, k, v, start, end, interpret=True, **change.get("tuning", {}))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_lowers_for_cuda(num_splits):
    """The Triton lowering (as on the GPU) accepts the kernel: dynamic loop bounds from scalar
    loads, masked tile loads, G = 7 padded to 16, a 4-D cache indexed by (row, KV head)."""
    sds = jax.ShapeDtypeStruct
    b, s, kv_heads, g, d = 2, 2304, 4, 7, 128
    f = jax.jit(functools.partial(da._decode_attention, interpret=False, num_splits=num_splits))
    exported = jax.export.export(
        f, platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    )(
        sds((b, kv_heads * g, d), jnp.bfloat16),
        sds((b, s, kv_heads, d), jnp.bfloat16),
        sds((b, s, kv_heads, d), jnp.bfloat16),
        sds((b,), jnp.int32),
        sds((b,), jnp.int32),
    )
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1
