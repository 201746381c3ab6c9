"""4-bit weight quantization: NVFP4, MXFP4 and NF4, all producing `PackedWeight`.

  packed = quantize(w, "nvfp4")            # w [..., N, K], any float dtype
  w_hat = dequantize(packed, jnp.float32)  # [..., N, K]
  params = quantize_params(params, "nvfp4")

The config string picks the format: "bf16" (dense, not a quantized format: use
`maybe_quantize`) | "nvfp4" | "mxfp4" | "nf4". Everything is pure jnp and jit-able with the
format static (`jax.jit(quantize, static_argnums=1)`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qerl_jax.projections import FUSED_GROUPS, PROJECTIONS
from qerl_jax.quant import compressed_tensors
from qerl_jax.quant.formats import CONFIG_FORMATS, DENSE, FORMATS, REGISTRY, Format
from qerl_jax.quant.mxfp4 import quantize_mxfp4
from qerl_jax.quant.nf4 import quantize_nf4
from qerl_jax.quant.nvfp4 import quantize_nvfp4
from qerl_jax.quant.packed import PackedWeight, dequantize, is_packed

__all__ = [
    "CONFIG_FORMATS",
    "DENSE",
    "FORMATS",
    "REGISTRY",
    "Format",
    "PackedWeight",
    "compressed_tensors",
    "dequantize",
    "is_packed",
    "maybe_quantize",
    "quantize",
    "quantize_params",
]

_DENSE_ONLY = ("embed", "lm_head")  # read as dense matrices by the model (gather / logits)

# Jitted so that eager calls compile once per shape instead of op by op; under an outer
# jit they are simply inlined.
_QUANTIZERS = {"nvfp4": jax.jit(quantize_nvfp4), "mxfp4": jax.jit(quantize_mxfp4), "nf4": jax.jit(quantize_nf4)}
_all_finite = jax.jit(lambda w: jnp.all(jnp.isfinite(w)))
_amax = jax.jit(lambda w: jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(-2, -1)))


def _check_format(fmt: str) -> None:
    if fmt == DENSE:
        raise ValueError(
            "'bf16' is not a quantized format: quantize() only produces 4-bit PackedWeights "
            f"({', '.join(FORMATS)}); use maybe_quantize(w, 'bf16') to keep a weight dense"
        )
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {CONFIG_FORMATS}")


def _check_weight(w: jax.Array, fmt: str, name: str | None) -> None:
    what = f"weight {name!r}" if name else "weight"
    if is_packed(w):
        raise TypeError(f"{what} is already a PackedWeight ({w.fmt}); expected a dense array")
    if w.ndim < 2:
        raise ValueError(f"{what} must be [..., N, K]; got shape {tuple(w.shape)}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"{what} must have a float dtype; got {w.dtype}")
    block = REGISTRY[fmt].block_size
    if w.shape[-1] % block:
        raise ValueError(
            f"{fmt} quantizes blocks of {block} along K (the last axis); {what} has shape "
            f"{tuple(w.shape)} and K={w.shape[-1]} is not a multiple of {block}"
        )
    try:
        finite = bool(_all_finite(w))
    except jax.errors.ConcretizationTypeError:  # traced under jit: values unknown here
        return
    if not finite:
        raise ValueError(f"{what} has non-finite values (inf or nan); cannot quantize it")


def quantize(w: jax.Array, fmt: str, *, amax: jax.Array | None = None, name: str | None = None) -> PackedWeight:
    """Quantizes a dense weight W [..., N, K] (HF layout, any float dtype) to `fmt`.

    fmt: "nvfp4" | "mxfp4" | "nf4" (static under jit).
    amax: nvfp4 only: float32 [...] absolute max to derive the global scale from (e.g. the
      max over fused q/k/v shards); default amax(W) per matrix.
    name: the tensor's name, used in error messages.
    Raises ValueError for "bf16"/unknown formats, K not a multiple of the block size and
    non-finite weights (checked when W is concrete, i.e. not under jit).
    """
    _check_format(fmt)
    w = jnp.asarray(w)
    _check_weight(w, fmt, name)
    if amax is not None and fmt != "nvfp4":
        raise ValueError(f"amax only applies to nvfp4 (the global scale); got it for {fmt!r}")
    return _quantize_checked(w, fmt, amax)


def _quantize_checked(w: jax.Array, fmt: str, amax: jax.Array | None) -> PackedWeight:
    """quantize() without the input checks (done by the caller)."""
    if fmt == "nvfp4":
        return _QUANTIZERS[fmt](w, amax=amax)
    return _QUANTIZERS[fmt](w)


def maybe_quantize(w: jax.Array, fmt: str, **kw) -> jax.Array | PackedWeight:
    """`quantize(w, fmt)` for a 4-bit format; w cast to bfloat16 for "bf16"."""
    if fmt == DENSE:
        return jnp.asarray(w).astype(jnp.bfloat16)
    return quantize(w, fmt, **kw)


def quantize_params(
    params: dict[str, Any],
    fmt: str,
    *,
    skip: tuple[str, ...] = ("embed", "lm_head"),
    fuse_global_scale: bool = True,
) -> dict[str, Any]:
    """Quantizes every `params["base"]["layers"][proj]["w"]` ([L, N, K] dense) to `fmt`.

    skip: names that stay dense: projection names (e.g. "down_proj") and "embed"/"lm_head",
      which the model always reads dense and so must be listed.
    fuse_global_scale: (nvfp4) q/k/v and gate/up of a layer share one global scale, derived
      from their joint amax, as vLLM requires of a checkpoint (it fuses those matmuls and
      keeps only the max of their global scales).
    Biases, norms, LoRA, embed and lm_head are returned unchanged (same arrays). For "bf16"
    the projection weights are cast to bfloat16.
    """
    if fmt != DENSE:
        _check_format(fmt)
    unknown = [s for s in skip if s not in PROJECTIONS + _DENSE_ONLY]
    if unknown:
        raise ValueError(f"skip names {unknown} are unknown; expected names from {PROJECTIONS + _DENSE_ONLY}")
    must_skip = [s for s in _DENSE_ONLY if s not in skip]
    if must_skip:
        raise ValueError(
            f"skip must contain {must_skip}: the model reads embed/lm_head as dense matrices, "
            "so they cannot be quantized"
        )
    layers = params["base"]["layers"]
    todo = [p for p in PROJECTIONS if p in layers and p not in skip]
    for proj in todo:
        w = layers[proj]["w"]
        if is_packed(w):
            raise ValueError(f"params['base']['layers']['{proj}']['w'] is already quantized ({w.fmt})")
        if fmt != DENSE:
            _check_weight(jnp.asarray(w), fmt, f"base.layers.{proj}.w")

    amax = {}
    if fmt == "nvfp4":
        for proj in todo:
            amax[proj] = _amax(jnp.asarray(layers[proj]["w"]))
        if fuse_global_scale:
            for group in FUSED_GROUPS:
                members = [p for p in group if p in amax]
                if len(members) > 1:
                    joint = jnp.max(jnp.stack([amax[p] for p in members]), axis=0)
                    amax.update({p: joint for p in members})

    new_layers = dict(layers)
    for proj in todo:
        w = jnp.asarray(layers[proj]["w"])
        qw = w.astype(jnp.bfloat16) if fmt == DENSE else _quantize_checked(w, fmt, amax.get(proj))
        new_layers[proj] = {**layers[proj], "w": qw}
    base = {**params["base"], "layers": new_layers}
    return {**params, "base": base}
