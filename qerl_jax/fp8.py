"""FP8 (E4M3) copies of the frozen base for the matmuls of many rows (W4A8 on Hopper's FP8 tensor cores).

The frozen base never changes, so each packed (NVFP4) weight is dequantized once and stored again as
float8_e4m3fn with one float32 scale per output channel (`Fp8Weight`): the train step's copies at
set-up (`linear.fp8_train_base`), the rollout's once per call from its bf16 copies
(`rollout.weights.add_fp8_copies`).

    w_NxK = e4m3(W / scale_N),  scale_N = amax_k |W[n, k]| / 448

K-major, as x [M, K] is: XLA's FP8 dot runs on cuBLASLt's FP8 kernels only with both operands
contracted on their last axis (measured before this module, H200, 7B layer shapes, e4m3 operands,
bf16 out: 1.6-1.9x a bf16 dot at 1,024-4,096 rows with W [N, K]; 2.5x slower than bf16 with W [K, N]).

At matmul time the activations are quantized per token the same way (`quantize_rows`), the FP8 dot
accumulates in float32, and the two scales multiply its output (`fp8_matmul`). The input gradient of
the train step, dx = g @ W, contracts W on N: the train copies hold W transposed too (`wt_KxN`, one
scale per input channel), so the backward is an FP8 dot of K-major operands as well; without it (the
rollout's copies) the backward dequantizes `w_NxK` to the cotangent's dtype.

Numerics: E4M3 keeps 4 significant bits; NVFP4's values (E2M1 codes times E4M3 block scales, times
a float32 global scale) have more, so the copy rounds the base once more, and the activations keep 4
of bf16's 8. The rollout's log-probs and the train forward's then differ from the bf16-activation path's;
the PPO ratio against the sampler's log-probs and TIS/MIS account for the sampler's part.

Measured (H200, 2026-11-28, `benchmarks/devtools/fp8_linear.py`, 7B layer shapes, one layer's four
matmuls q+k+v / o / gate+up / down): forward 1.23x / 1.27x / 1.47x the bf16 dot at 256 / 1,024 /
4,096 rows, input gradient 1.50x / 1.30x / 1.63x; each product 3.75% off the bf16 path's (relative
Frobenius norm); the program holds cuBLASLt's FP8 GEMM (`__cublas$lt$matmul$f8`). On a random 1.5B
NVFP4 model (28 layers, 1,024 tokens) the FP8 forward's log-probs were 0.19 nats off the bf16 path's
at the tokens (KL 0.029 per position, near-uniform outputs of entropy 11.6); on the real Qwen2.5-Coder-1.5B
over GSM8K text 0.068 nats (KL 0.0068 a position). End to end (4 x H200, one case a GPU, 2026-11-28): the 7B
recipe's GRPO step 1.18x bf16's (train phase 1.21x), greedy GSM8K of the real 1.5B -1.4 points, and the
rollout's first call slow (XLA autotunes the FP8 GEMMs of every row bucket): `model.fp8_matmul` is "off" by
default (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from qerl_jax.quant.packed import PackedWeight, dequantize, is_packed

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MODES = ("auto", "on", "off")
# Matmuls of at least this many rows run in FP8 where FP8 copies exist: from 256 rows on the 7B
# layer's FP8 matmuls beat bf16 (module doc); fewer rows were not measured (the decode buckets of 64
# and 16 rows are bound by reading the weights, and the activations' quantization is a pass of its own).
MIN_ROWS = 256
# XLA's options for the train step's program when its base has FP8 copies. With Triton GEMM fusions
# on, XLA's autotuner timed Triton configurations for every FP8 dot of the 7B recipe's micro-batch
# (8 packed rows of 2,304 tokens: 18,432 rows) and the step's first compile had not returned after
# ~200 s (H200, 2026-11-28); off, each dot is one cuBLASLt FP8 GEMM, the kernel `benchmarks/devtools/
# fp8_linear.py` measured.
TRAIN_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


@struct.dataclass
class Fp8Weight:
    """A frozen weight W [..., N, K] as E4M3 with per-output-channel float32 scales:
    W ~= w_NxK * scale_N[:, None]. wt_KxN / scale_K: W.T the same way per input channel (W ~=
    (wt_KxN * scale_K[:, None]).T), for the input gradient's FP8 dot; None where no backward runs."""

    w_NxK: jax.Array  # float8_e4m3fn [..., N, K]
    scale_N: jax.Array  # float32 [..., N]
    wt_KxN: jax.Array | None = None  # float8_e4m3fn [..., K, N]
    scale_K: jax.Array | None = None  # float32 [..., K]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w_NxK.shape)


def is_fp8(w: Any) -> bool:
    return isinstance(w, Fp8Weight)


def quantize_rows(x_MxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(e4m3 x / scale_M[:, None], float32 scale_M = amax_k |x[m, k]| / 448; 1 for an all-zero row)
    over the last axis (any leading axes)."""
    x = x_MxK.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale


def from_dense(w_NxK: jax.Array, transposed: bool = False) -> Fp8Weight:
    """The FP8 copy of a dense W [..., N, K] (with W.T's too when `transposed`, for training)."""
    q, s = quantize_rows(w_NxK)
    if not transposed:
        return Fp8Weight(q, s)
    qt, st = quantize_rows(jnp.swapaxes(w_NxK, -1, -2))
    return Fp8Weight(q, s, qt, st)


def from_packed(w: PackedWeight | jax.Array, transposed: bool = False) -> Fp8Weight:
    """The FP8 copy of a packed (or dense) W, through float32; a stack over layers [L, N, K] one
    layer at a time (`lax.map`), so the float32 intermediate is one layer's."""
    dense = (lambda p: dequantize(p, jnp.float32)) if is_packed(w) else (lambda a: a.astype(jnp.float32))
    if len(w.shape) == 2:
        return from_dense(dense(w), transposed)
    return jax.lax.map(lambda layer: from_dense(dense(layer), transposed), w)


from_packed_jit = jax.jit(from_packed, static_argnums=1)


def copy_bytes(shape: tuple[int, ...], transposed: bool = False) -> int:
    """Bytes of the FP8 copy of a weight of logical shape [..., N, K] (codes + scales)."""
    *lead, n, k = shape
    return math.prod(lead) * (n * k + 4 * n + ((n * k + 4 * k) if transposed else 0))


def _dot_nt(a_MxK: jax.Array, b_NxK: jax.Array) -> jax.Array:
    """float32 a @ b.T, both contracted on their last axis (the layout cuBLASLt's FP8 GEMM takes)."""
    return jax.lax.dot_general(a_MxK, b_NxK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def fp8_matmul(x_MxK: jax.Array, w: Fp8Weight) -> jax.Array:
    """float32 x @ W.T [M, N] for W an `Fp8Weight`: x quantized per row to E4M3, an FP8 dot with
    float32 accumulation, then both scales. The gradient is x's only (W is frozen): see the module doc."""
    x_q, x_scale = quantize_rows(x_MxK)
    return _dot_nt(x_q, w.w_NxK) * x_scale[:, None] * w.scale_N[None, :]


def _fp8_matmul_fwd(x_MxK, w):
    return fp8_matmul(x_MxK, w), (w, jnp.zeros((0,), x_MxK.dtype))


def _fp8_matmul_bwd(res, g_MxN):
    w, like = res
    if w.wt_KxN is not None:
        g_q, g_scale = quantize_rows(g_MxN)
        dx_MxK = _dot_nt(g_q, w.wt_KxN) * g_scale[:, None] * w.scale_K[None, :]
    else:  # no transposed copy: W dequantized in the cotangent's dtype, a dot contracted on N
        dtype = like.dtype
        w_NxK = (w.w_NxK.astype(jnp.float32) * w.scale_N[:, None]).astype(dtype)
        dx_MxK = jax.lax.dot_general(
            g_MxN.astype(dtype), w_NxK, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
    return dx_MxK.astype(like.dtype), None


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def reference_matmul(x_MxK: jax.Array, w: Fp8Weight) -> jax.Array:
    """fp8_matmul's math in float32 on the quantized values (for tests)."""
    x_q, x_scale = quantize_rows(x_MxK)
    x_f32 = x_q.astype(jnp.float32) * x_scale[:, None]
    w_f32 = w.w_NxK.astype(jnp.float32) * w.scale_N[:, None]
    return jnp.dot(x_f32, w_f32.T, precision=jax.lax.Precision.HIGHEST)


def available() -> bool:
    """Whether the default device has FP8 tensor cores (an NVIDIA GPU of compute capability >= 8.9:
    Ada, Hopper and later). Elsewhere XLA emulates the FP8 dot: slower than bf16, and no faster."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and capability is not None and float(capability) >= 8.9


def enabled(mode: str, quantized: bool, on_fp8_device: bool | None = None) -> bool:
    """Whether `mode` (one of MODES) gives the frozen base FP8 copies: "auto" for a quantized (4-bit)
    base on a device with FP8 tensor cores (`available`, or `on_fp8_device`), "on" for any base on
    any device, "off" never."""
    if mode not in MODES:
        raise ValueError(f"fp8 mode {mode!r}; expected one of {MODES}")
    if mode != "auto":
        return mode == "on"
    return quantized and (available() if on_fp8_device is None else on_fp8_device)


def train_copy_bytes(params: dict[str, Any]) -> int:
    """Bytes `linear.fp8_train_base` adds: the FP8 copies of every stacked layer weight, W and W.T."""
    layers = params["base"]["layers"]
    return sum(copy_bytes(tuple(p["w"].shape), True) for p in layers.values() if len(p["w"].shape) == 3)
