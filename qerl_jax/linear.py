"""The one linear function every projection of the model goes through.

Swapping the base weights between dense bf16 and packed 4-bit formats, choosing the matmul
backend and adding the LoRA delta all happen here, so the model code never branches on them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from qerl_jax import fp8
from qerl_jax.quant.packed import PackedWeight, dequantize, is_packed, split_specs, splits_over

BACKENDS = ("xla", "pallas")
# Up to this many rows `fused_linear` takes its adapters' first matmul (where its weight does not
# hold their A: the wgmma kernel's) as a multiply-reduce (`_lora_down`): one launch fewer a call
# (H100 program, Qwen2.5-7B NVFP4 + LoRA r16, 16 and 64 rows alike). Each row reads A again.
REDUCED_LORA_A_MAX_ROWS = 16
# The name (`jax.ad_checkpoint.checkpoint_name`) of every projection's output, in the activations'
# dtype: the "proj" remat policy of the model saves these instead of recomputing the matmuls.
PROJ_OUT = "proj_out"


@struct.dataclass
class LayerOf:
    """Layer `index` of a weight stacked over layers ([L, N, K] dense or packed), used where
    it lies: the Pallas kernel reads the layer's rows inside the stack, the XLA path fuses
    the slice into the dequantization. A plain `stack[index]` before a matmul would make
    XLA copy the slice first (every call, e.g. every decode step)."""

    stack: Any  # jax.Array [L, N, K] | PackedWeight with leading L axis
    index: jax.Array  # int32 scalar (may be traced: one trace serves every layer)


@struct.dataclass
class ByRows:
    """One weight in two layouts: `small` for matmuls of at most `max_rows` rows (e.g. the
    rollout's decode steps through a kernel-specific repacking), `large` for the others (e.g.
    the prefill, reading the original packed stack in place)."""

    small: Any
    large: Any
    max_rows: int = struct.field(pytree_node=False)


@struct.dataclass
class Fused:
    """Projections of one input stacked along N into one weight `w` ([sum(sizes), K], rows in the
    order of the projections), for matmuls of at most `max_rows` rows: one kernel call instead of
    several (e.g. q/k/v and gate/up in the rollout's decode steps). See `fused_linear`.

    lora_rows: when > 0, `w` has that many more rows below the projections' ([sum(sizes) + R, K]):
    their adapters' A, stacked as `stack_loras` stacks them, so the adapters' first matmul rides on
    the base one (a dense weight only)."""

    w: Any
    sizes: tuple[int, ...] = struct.field(pytree_node=False)
    max_rows: int = struct.field(pytree_node=False)
    lora_rows: int = struct.field(pytree_node=False, default=0)


def _take_layer(w: LayerOf) -> jax.Array | PackedWeight:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, w.index, keepdims=False), w.stack)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def matmul_nt(x_MxK: jax.Array, w_NxK: jax.Array) -> jax.Array:
    """float32 x @ W.T [M, N], W cast to x's dtype (bf16 x bf16 products, float32 accumulation).

    The gradients are the same products: the float32 cotangent is rounded to x's dtype first, so a
    bf16 model's backward runs bf16 matmuls (as PyTorch autocast does) instead of the float32 ones
    plain autodiff makes of a float32 cotangent (tf32 GEMMs at half the bf16 rate, twice the
    bytes; H100, Qwen2.5-7B LoRA train step: 1.6 s of 6.8). With float32 x it is plain autodiff.
    """
    return _dot(x_MxK, w_NxK.astype(x_MxK.dtype), (1, 1))


def _matmul_nt_fwd(x_MxK, w_NxK):
    return matmul_nt(x_MxK, w_NxK), (x_MxK, w_NxK)


def _matmul_nt_bwd(res, g_MxN):
    x_MxK, w_NxK = res
    g_MxN = g_MxN.astype(x_MxK.dtype)
    dx_MxK = _dot(g_MxN, w_NxK.astype(x_MxK.dtype), (1, 0)).astype(x_MxK.dtype)
    dw_NxK = _dot(g_MxN, x_MxK, (0, 0)).astype(w_NxK.dtype)  # dropped by XLA where W is frozen
    return dx_MxK, dw_NxK


matmul_nt.defvjp(_matmul_nt_fwd, _matmul_nt_bwd)


def _is_wgmma(w) -> bool:
    return type(w).__name__ == "WgmmaWeight"  # pallas_kernels is only imported where it is used


def base_matmul(
    x_MxK: jax.Array, w: jax.Array | PackedWeight | LayerOf, backend: str = "xla", parallel: str | None = None
) -> jax.Array:
    """x [M, K] @ W.T for W [N, K] dense, packed or one layer of a stack (`LayerOf`); float32 [M, N].
    parallel: "column" or "row", how tensor parallelism splits W (`projections.COLUMN_PARALLEL`).

    W may also be a `pallas_kernels.wgmma_nvfp4.WgmmaWeight` (NVFP4 repacked for the Hopper
    decode kernel, made by the rollout): its kernel on Hopper at small M, else dequantize + dot;
    or an `fp8.Fp8Weight` (the base in E4M3 for matmuls of many rows): x quantized per row, an FP8 dot.
    """
    if isinstance(w, ByRows):
        return base_matmul(x_MxK, w.small if x_MxK.shape[0] <= w.max_rows else w.large, backend, parallel)
    if isinstance(w, LayerOf) and fp8.is_fp8(w.stack):
        w = _take_layer(w)
    if fp8.is_fp8(w):
        return fp8.fp8_matmul(x_MxK, w)
    if _is_wgmma(w):
        from pallas_kernels import wgmma_nvfp4

        return wgmma_nvfp4.wgmma_linear(x_MxK, w)
    layer = None
    if isinstance(w, LayerOf):
        if is_packed(w.stack) and backend == "pallas":  # the kernel indexes the stack itself
            w, layer = w.stack, w.index
        else:
            w = _take_layer(w)
    if not is_packed(w):
        return matmul_nt(x_MxK, w)
    if backend == "pallas":
        return _quant_matmul(x_MxK.astype(jnp.bfloat16), w, layer, parallel)
    if backend == "xla":
        return matmul_nt(x_MxK, dequantize(w, x_MxK.dtype))
    raise ValueError(f"unknown linear backend {backend!r}; expected one of {BACKENDS}")


def fp8_train_base(params: dict[str, Any], min_rows: int | None = None) -> dict[str, Any]:
    """params with each stacked layer weight [L, N, K] (packed or dense) in two layouts, for the
    train step: `linear.ByRows` of the weight itself for matmuls of fewer than `min_rows` rows and
    its `fp8.Fp8Weight` (W and W.T) for the others (default `fp8.MIN_ROWS`). Made once; the rollout
    takes the plain params."""
    min_rows = fp8.MIN_ROWS if min_rows is None else min_rows
    layers = params["base"]["layers"]
    out = {}
    for name, p in layers.items():
        w = p["w"]
        if isinstance(w, ByRows) or not (is_packed(w) or isinstance(w, jax.Array)) or len(w.shape) != 3:
            out[name] = p
            continue
        out[name] = {**p, "w": ByRows(w, fp8.from_packed_jit(w, True), max_rows=min_rows - 1)}
    return {**params, "base": {**params["base"], "layers": out}}


def model_devices() -> int:
    """The devices of the "model" axis of the abstract mesh set while tracing (1: none set). The
    rollout and the train step over tensor-parallel weights set its mesh (`kernels_per_model_device`)
    so that the Pallas kernels, which XLA cannot split (left to it, every device gathers the
    kernel's whole operands first: the packed weights, the KV cache), run per device on its own part."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("model", 1)


def model_mesh(params) -> jax.sharding.Mesh | None:
    """The mesh of tensor-parallel params (its "model" axis has several devices), else None."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and dict(sharding.mesh.shape).get("model", 1) > 1:
            return sharding.mesh
    return None


def kernels_per_model_device(params):
    """A context in which programs over `params` trace with the abstract mesh of tensor-parallel
    params, so that the model's Pallas kernels run per device on their own part (`model_devices`);
    no mesh for other params. Set around every jitted call (and lowering) of the rollout and the
    train step."""
    mesh = model_mesh(params)
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def per_model_device(fn, in_specs, out_specs):
    """`fn` run by each device of the "model" axis on its blocks (`jax.shard_map`; other axes automatic)."""
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={"model"}, check_vma=False)


def _kernel(x_MxK: jax.Array, w: PackedWeight, layer) -> jax.Array:
    import pallas_kernels  # imported lazily: the kernels are only needed on this path

    return pallas_kernels.quant_matmul(x_MxK, w, layer=layer)


def _quant_matmul(x_MxK: jax.Array, w: PackedWeight, layer, parallel: str | None) -> jax.Array:
    """The Pallas kernel on packed W (layer `layer` of a stack, or W itself); with a "model" axis
    (`model_devices`) that splits W as `sharding` does, each device multiplies its own part: a
    column-parallel W its output features, a row-parallel W its input features (then summed)."""
    m = model_devices()
    *_, n, k = w.shape
    if m > 1 and parallel == "column" and splits_over(n, k, -2, m, w.block_size):
        return _column_parallel_matmul(x_MxK, w, layer)
    if m > 1 and parallel == "row" and splits_over(n, k, -1, m, w.block_size):
        return _row_parallel_matmul(x_MxK, w, layer)
    return _kernel(x_MxK, w, layer)


def _input_cotangent(x, w, layer, dy):
    """The kernel's cotangent for its input x (W frozen), on one device's operands."""
    _, pullback = jax.vjp(lambda x_: _kernel(x_, w, layer), x)
    return pullback(dy)[0]


@jax.custom_vjp
def _column_parallel_matmul(x_MxK: jax.Array, w: PackedWeight, layer) -> jax.Array:
    """The kernel per "model" device on its output features. Its own VJP, so that the input's
    cotangent (each device's partial sum over its features) is summed in float32; shard_map's
    transpose would sum the kernel's bf16 results (and XLA's CPU compiler rejects that program)."""
    return per_model_device(_kernel, (P(), split_specs(w, -2, "model"), P()), P(None, "model"))(x_MxK, w, layer)


def _column_fwd(x_MxK, w, layer):
    return _column_parallel_matmul(x_MxK, w, layer), (x_MxK, w, layer)


def _column_bwd(res, dy_MxN):
    x_MxK, w, layer = res
    summed = lambda *a: jax.lax.psum(_input_cotangent(*a).astype(jnp.float32), "model")  # noqa: E731
    specs = (P(), split_specs(w, -2, "model"), P(), P(None, "model"))
    dx_MxK = per_model_device(summed, specs, P())(x_MxK, w, layer, dy_MxN)
    return dx_MxK.astype(x_MxK.dtype), None, None  # W is frozen, the layer an index


_column_parallel_matmul.defvjp(_column_fwd, _column_bwd)


@jax.custom_vjp
def _row_parallel_matmul(x_MxK: jax.Array, w: PackedWeight, layer) -> jax.Array:
    """The kernel per "model" device on its input features, the partial products summed. Its own
    VJP: every device holds the whole output cotangent and computes its own input features'
    cotangent, with no collective (shard_map's transpose would all-reduce the cotangent again)."""
    summed = lambda x, w, layer: jax.lax.psum(_kernel(x, w, layer), "model")  # noqa: E731
    return per_model_device(summed, (P(None, "model"), split_specs(w, -1, "model"), P()), P())(x_MxK, w, layer)


def _row_fwd(x_MxK, w, layer):
    return _row_parallel_matmul(x_MxK, w, layer), (x_MxK, w, layer)


def _row_bwd(res, dy_MxN):
    x_MxK, w, layer = res
    specs = (P(None, "model"), split_specs(w, -1, "model"), P(), P())
    return per_model_device(_input_cotangent, specs, P(None, "model"))(x_MxK, w, layer, dy_MxN), None, None


_row_parallel_matmul.defvjp(_row_fwd, _row_bwd)


def linear(
    x: jax.Array,
    w: jax.Array | PackedWeight | LayerOf,
    *,
    bias: jax.Array | None = None,
    lora: dict[str, Any] | None = None,
    lora_scale: float = 1.0,
    backend: str = "xla",
    parallel: str | None = None,
) -> jax.Array:
    """y [..., N] = x [..., K] @ W.T (+ bias) (+ lora_scale * x @ A.T @ B.T), in x.dtype.

    W is [N, K] (HF layout), dense or a `PackedWeight`; lora is {"a": [r, K], "b": [N, r]}.
    Accumulation is float32. parallel: see `base_matmul`.
    """
    x_MxK = x.reshape(-1, x.shape[-1])
    with jax.named_scope("base_matmul"):
        y_MxN = base_matmul(x_MxK, w, backend, parallel)
    return _finish(x, x_MxK, y_MxN, bias, lora, lora_scale)


def fused_linear(
    x: jax.Array,
    fused: Fused,
    *,
    biases: list[jax.Array | None],
    lora: dict[str, Any] | None = None,
    lora_scale: float = 1.0,
    backend: str = "xla",
    row_scale: jax.Array | None = None,
) -> list[jax.Array]:
    """[`linear`(x, W_i, bias=biases[i], lora=LoRA_i) for each projection i of `fused`], with one
    matmul for the base weights (x [..., K] with at most fused.max_rows rows of K) and two for
    the adapters (one where `fused.lora_rows` holds their A): `lora` is the projections' adapters
    stacked by `stack_loras`, or None.

    row_scale: float32 [M, 1] (M = x's rows) or None: the projections of row_scale * x, the scale
    applied to each row's float32 result (base and adapters' delta) instead of to x, before the
    bias (`qwen2.rms_norm_parts`: a norm's 1/rms after the matmul); the adapters' rank-r
    intermediate is then rounded unscaled, so the two differ by that rounding."""
    x_MxK = x.reshape(-1, x.shape[-1])
    if x_MxK.shape[0] > fused.max_rows:
        raise ValueError(f"this fused weight serves at most {fused.max_rows} rows; got {x_MxK.shape[0]}")
    if len(biases) != len(fused.sizes):
        raise ValueError(f"{len(fused.sizes)} projections need as many biases; got {len(biases)}")
    if fused.lora_rows and (lora is None or lora["b"].shape[1] != fused.lora_rows):
        got = None if lora is None else lora["b"].shape[1]
        raise ValueError(f"this fused weight holds the A of a rank-{fused.lora_rows} stacked LoRA; got rank {got}")
    y_MxN = base_matmul(x_MxK, fused.w, backend)
    n = sum(fused.sizes)
    if lora is not None:
        if lora["b"].shape[0] != n:
            raise ValueError(f"the stacked LoRA B has {lora['b'].shape[0]} rows; the fused weight {n}")
        with jax.named_scope("lora"):
            h_MxR = y_MxN[:, n:] if fused.lora_rows else _lora_down(x_MxK, lora["a"])
            y_MxN = y_MxN[:, :n] + _lora_up(h_MxR, lora["b"], lora_scale, x_MxK.dtype)
    y_MxN = y_MxN[:, :n] if row_scale is None else y_MxN[:, :n] * row_scale
    splits = np.cumsum(fused.sizes)[:-1].tolist()
    return [
        _finish(x, x_MxK, y_i, bias, None, lora_scale)
        for y_i, bias in zip(jnp.split(y_MxN, splits, axis=1), biases, strict=True)
    ]


def stack_loras(loras: list[dict[str, Any] | None], sizes: tuple[int, ...]) -> dict[str, Any] | None:
    """The adapters of projections fused along N (`Fused`, out sizes `sizes`) as one adapter:
    {"a": [R, K] the A's stacked, "b": [sum(sizes), R] the B's block-diagonal, zeros where a
    projection has none}, R the sum of their ranks; None when none has one. Its delta is the
    projections' deltas side by side (the zero blocks add exact zeros), in two matmuls instead of
    two per projection; the zeros cost (R - r_i) x N_i extra B entries per projection."""
    if len(loras) != len(sizes):
        raise ValueError(f"{len(sizes)} projections need as many LoRA entries (None for none); got {len(loras)}")
    present = [(i, lora) for i, lora in enumerate(loras) if lora is not None]
    if not present:
        return None
    dtype = jnp.result_type(*[lora["b"].dtype for _, lora in present])
    a_RxK = jnp.concatenate([lora["a"].astype(dtype) for _, lora in present])
    starts = np.concatenate([[0], np.cumsum(sizes)])
    b_NxR = jnp.zeros((int(starts[-1]), a_RxK.shape[0]), dtype)
    col = 0
    for i, lora in present:
        if lora["b"].shape[0] != sizes[i]:
            raise ValueError(f"LoRA {i} has B with {lora['b'].shape[0]} rows; its projection has {sizes[i]}")
        rank = lora["b"].shape[1]
        b_NxR = b_NxR.at[starts[i] : starts[i + 1], col : col + rank].set(lora["b"].astype(dtype))
        col += rank
    return {"a": a_RxK, "b": b_NxR}


def _lora_delta(x_MxK: jax.Array, lora: dict[str, Any], scale: float) -> jax.Array:
    """float32 scale * x @ A.T @ B.T [M, N], the rank-r intermediate scaled and rounded to x's dtype.

    The scale multiplies the [M, r] intermediate, not the [M, N] delta: in the backward the
    delta's cotangent then reaches B's matmul as is, instead of as a scaled copy of an [M, N]
    array per projection (H100, 7B LoRA train step: 0.16 s of 3.6)."""
    with jax.named_scope("lora"):
        return _lora_up(matmul_nt(x_MxK, lora["a"]), lora["b"], scale, x_MxK.dtype)


def _lora_down(x_MxK: jax.Array, a_RxK: jax.Array) -> jax.Array:
    """float32 x @ A.T [M, R] of a fused call's adapters: up to REDUCED_LORA_A_MAX_ROWS rows as a
    multiply-reduce over K (the same products, exact in float32, summed in another order), which
    XLA compiles to one reduction kernel, where its GEMM of N = R is split over K and its partial
    sums added by a second kernel (H100 program, Qwen2.5-7B wgmma decode step: RESULTS.md)."""
    if x_MxK.shape[0] > REDUCED_LORA_A_MAX_ROWS:
        return matmul_nt(x_MxK, a_RxK)
    x32, a32 = x_MxK.astype(jnp.float32), a_RxK.astype(x_MxK.dtype).astype(jnp.float32)
    return jnp.sum(x32[:, None, :] * a32[None], axis=-1)


def _lora_up(h_MxR: jax.Array, b_NxR: jax.Array, scale: float, dtype) -> jax.Array:
    """float32 (scale * h, rounded to `dtype`) @ B.T [M, N]: the adapter's second matmul."""
    return matmul_nt((scale * h_MxR).astype(dtype), b_NxR)


def _finish(x, x_MxK, y_MxN, bias, lora, lora_scale) -> jax.Array:
    """float32 x @ W.T [M, N] (+ bias) (+ LoRA delta) -> x.dtype [..., N]."""
    if bias is not None:
        y_MxN = y_MxN + bias.astype(jnp.float32)
    if lora is not None:
        y_MxN = y_MxN + _lora_delta(x_MxK, lora, lora_scale)
    y_MxN = checkpoint_name(y_MxN.astype(x.dtype), PROJ_OUT)
    return y_MxN.reshape(*x.shape[:-1], y_MxN.shape[-1])
