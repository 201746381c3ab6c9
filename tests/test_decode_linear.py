"""The fused decode projection (pallas_kernels/decode_linear.py) in interpret mode on CPU.

The kernel runs with its output NaN-filled first (poison), on ragged shapes (rows 1..16, K not a
multiple of the K step, columns not a multiple of the column tile, a LoRA rank that is not a
power of two), and is checked against a float64 numpy computation written here (the inputs
rounded to bf16 as the kernel reads them, no rounding inside) and against its jnp reference (the
same roundings, so a tighter bound). The Triton lowering is checked on the CPU too
(jax.export for CUDA), since the interpreter accepts what the GPU compiler may not.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_linear as dl


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _bf16(rng, *shape, scale=1.0):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(jnp.bfloat16)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def numpy_reference(x, w, *, n, b=None, s=1.0, bias=None, norm=None, eps=1e-6, epilogue="none", res=None):
    """float64: epilogue((norm(x) @ W[:n].T + s * norm(x) @ A.T @ B.T) + bias)."""
    x, w = _f64(x), _f64(w)
    if norm is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(norm)
    y = x @ w[:n].T
    if b is not None:
        y = y + s * (x @ w[n:].T) @ _f64(b).T
    if bias is not None:
        y = y + _f64(bias)
    if epilogue == "silu_mul":
        g, u = y[:, : n // 2], y[:, n // 2 :]
        return g / (1 + np.exp(-g)) * u
    if epilogue == "residual":
        return _f64(res) + y
    return y


def rel_err(out, ref) -> float:
    out = _f64(out)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "NaN in the output: an element the kernel did not write"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_case(m, k, n, rank, epilogue, *, bias=False, norm=False, seed=0):
    rng = _rng(m, k, n, rank, epilogue, bias, norm, seed)
    x = _bf16(rng, m, k, scale=3.0 if norm else 1.0)  # a residual stream is not unit-scaled
    w = _bf16(rng, n + rank, k, scale=k**-0.5)
    kw = dict(n=n)
    if rank:
        kw.update(lora_b_NxR=_bf16(rng, n, rank, scale=0.5), lora_scale=2.0)
    if bias:
        kw["bias_N"] = _bf16(rng, n, scale=0.3)
    if norm:
        kw["norm_K"] = jnp.asarray(1.0 + 0.1 * rng.standard_normal(k), jnp.float32)
    n_out = n // 2 if epilogue == "silu_mul" else n
    if epilogue == "residual":
        kw["residual_MxN"] = _bf16(rng, m, n_out)
    return x, w, kw


def np_kwargs(kw):
    return dict(
        n=kw["n"], b=kw.get("lora_b_NxR"), s=kw.get("lora_scale", 1.0), bias=kw.get("bias_N"),
        norm=kw.get("norm_K"), res=kw.get("residual_MxN"),
    )  # fmt: skip


CASES = [  # m, k, n, rank, epilogue, bias, norm, bk, bn
    (1, 256, 96, 16, "none", True, True, 128, None),  # one row, q/k/v-like: bias, norm, LoRA
    (3, 200, 72, 48, "none", False, False, 64, 16),  # ragged K and columns, rank 48 padded to 64
    (16, 128, 64, 0, "none", True, False, 128, 32),  # full tile, no adapter
    (5, 192, 2 * 40, 32, "silu_mul", False, True, 64, 16),  # gate/up: ragged halves
    (16, 320, 2 * 64, 16, "silu_mul", False, True, 128, 32),
    (2, 96, 48, 16, "residual", False, False, 32, 16),  # o / down: residual epilogue
    (9, 640, 112, 0, "residual", True, False, 256, 32),
]


@pytest.mark.parametrize("m,k,n,rank,epilogue,bias,norm,bk,bn", CASES)
def test_kernel_matches_float64_and_jnp_references(m, k, n, rank, epilogue, bias, norm, bk, bn):
    x, w, kw = make_case(m, k, n, rank, epilogue, bias=bias, norm=norm)
    out = dl.decode_linear(x, w, epilogue=epilogue, bk=bk, bn=bn, interpret=True, poison=True, **kw)
    n_out = n // 2 if epilogue == "silu_mul" else n
    assert out.shape == (m, n_out) and out.dtype == jnp.bfloat16
    ref64 = numpy_reference(x, w, epilogue=epilogue, **np_kwargs(kw))
    assert rel_err(out, ref64) < 1.5e-2
    ref = dl.decode_linear_reference(x, w, epilogue=epilogue, **kw)
    assert rel_err(out, _f64(ref)) < 4e-3
    assert rel_err(ref, ref64) < 1.5e-2  # the jnp reference is the same computation


def test_each_part_changes_the_output():
    """The adapter, the bias, the norm and the residual each reach the output (a kernel that
    dropped one would still be near a reference that dropped it too)."""
    x, w, kw = make_case(4, 128, 64, 16, "residual", bias=True, norm=True)
    full = _f64(dl.decode_linear(x, w, epilogue="residual", interpret=True, **kw))
    for drop in ("lora", "bias_N", "norm_K"):
        kw2 = dict(kw)
        if drop == "lora":
            kw2.pop("lora_b_NxR"), kw2.pop("lora_scale")
            w2 = w[: kw["n"]]
        else:
            kw2.pop(drop)
            w2 = w
        out = _f64(dl.decode_linear(x, w2, epilogue="residual", interpret=True, **kw2))
        assert np.abs(out - full).max() > 1e-2, drop
    res0 = dict(kw, residual_MxN=jnp.zeros_like(kw["residual_MxN"]))
    out = _f64(dl.decode_linear(x, w, epilogue="residual", interpret=True, **res0))
    assert np.abs(out - full).max() > 1e-2


def test_norm_matches_the_model_norm_in_parts():
    """The norm prologue is the model's `rms_norm_parts` followed by the row scale."""
    from qerl_jax.models import qwen2

    x, w, kw = make_case(3, 128, 32, 0, "none", norm=True)
    xs, inv_rms = qwen2.rms_norm_parts(x, kw["norm_K"], 1e-6)
    want = (jnp.einsum("mk,nk->mn", xs, w, preferred_element_type=jnp.float32) * inv_rms).astype(jnp.bfloat16)
    got = dl.decode_linear(x, w, interpret=True, **kw)
    assert rel_err(got, _f64(want)) < 4e-3


def test_block_n_fills_the_gpu():
    assert dl.block_n(17920 // 2) == 64  # 140 programs
    assert dl.block_n(1536) == 16  # 96 programs
    assert dl.block_n(2048) == 16
    assert dl.block_n(40) == 16


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(x=(17, 64)), "1..16 rows"),
        (dict(epilogue="gelu"), "epilogue must be"),
        (dict(w=(40, 64)), "W has 40 rows"),
        (dict(w=(48, 32)), "W must be"),
        (dict(residual=None), "needs a residual"),
    ],
)
def test_bad_input_is_rejected(change, match):
    rng = _rng("bad")
    x = _bf16(rng, *change.get("x", (2, 64)))
    w = _bf16(rng, *change.get("w", (48, 64)))
    epilogue = change.get("epilogue", "residual")
    residual = change.get("residual", _bf16(rng, 2, 32))
    with pytest.raises(ValueError, match=match):
        dl.decode_linear(x, w, n=32, lora_b_NxR=_bf16(rng, 32, 16), epilogue=epilogue, residual_MxN=residual)


@pytest.mark.parametrize("epilogue,m", [("none", 1), ("silu_mul", 16), ("residual", 3)])
def test_lowers_for_cuda(epilogue, m):
    """The Triton lowering (as on the GPU) accepts the kernel: masked loads past the arrays'
    ends from traced starts, the norm prologue, the adapter's padded rank, each epilogue."""
    sds = jax.ShapeDtypeStruct
    n, k, rank = 2 * 8960 if epilogue == "silu_mul" else 2048, 1536, 48
    n_out = n // 2 if epilogue == "silu_mul" else n
    args = [sds((m, k), jnp.bfloat16), sds((n + rank, k), jnp.bfloat16), sds((n, rank), jnp.bfloat16)]
    args += [sds((k,), jnp.float32)]
    if epilogue == "residual":
        args.append(sds((m, n_out), jnp.bfloat16))

    def f(x, w, b, norm, res=None):
        return dl.decode_linear(x, w, n=n, lora_b_NxR=b, norm_K=norm, epilogue=epilogue, residual_MxN=res,
                                interpret=False)  # fmt: skip

    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)  # fmt: skip
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.pad" not in text  # no padded copies of x or the residual around it
