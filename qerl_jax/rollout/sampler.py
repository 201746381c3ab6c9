"""Batched KV-cache generation on the (quantized, LoRA-adapted) policy.

    batch = generate(config, params, prompt_ids, prompt_mask, key, SamplingConfig(...), group_size=8)
    train = to_train_batch(batch)

Two jitted programs per shape bucket:

- prefill: the B distinct (left-padded) prompts in one forward that fills a prompt-sized
  KV cache, then each row is copied once per sample of its group (a gather on the batch
  axis) and padded to S = prompt bucket + new-token bucket slots; it also samples the first
  token. G samples of a prompt thus share one prefill.
- decode: a `lax.while_loop` feeding one token per row per step through the cache (donated,
  so it is updated in place), that stops once every row has met an EOS/stop id or after
  max_new_tokens.

Both run the model's own `DecoderLayer` layer by layer over per-layer copies of the stacked
weights and per-layer KV caches (see `_split_layers` for why; `unroll_layers=False` runs the
model's layer scan instead, with the same results).

Shapes are bucketed (prompt length: powers of two from 16, multiples of 1024 above 2048;
new tokens: multiples of 64; rows: powers of two up to 8, then multiples of 8), so a
training run compiles a handful of programs. The row order is prompt-major: row b * G + g
is sample g of prompt b.

Randomness: sequence r (its row in the full [B * G] output, whatever the chunking or prefill
sharing) draws its step-t token with key fold_in(fold_in(key, r), t). So results do not
depend on `max_batch`, on `share_prefill`, or on whether prompts are passed repeated with
group_size 1 or once with group_size G.

Log-probs are those of `sampling.sample`: log_softmax(logits / T) before top-k/top-p.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qerl_jax.linear import ByRows, Fused, LayerOf, stack_loras
from qerl_jax.models.qwen2 import (
    FUSABLE_PROJECTIONS,
    DecoderLayer,
    ForwardOptions,
    ModelConfig,
    Qwen2,
    fused_name,
    positions_from_mask,
    rms_norm,
    variables,
)
from qerl_jax.quant.packed import dequantize, is_packed
from qerl_jax.rollout.sampling import SamplingConfig, sample

# The memory check asks for this multiple of `estimate_rollout_bytes`: on an H100 (Qwen2.5-7B,
# 256 rows x 768 slots) the measured process peak exceeded weights + estimate by ~8 GB (~20%).
MEMORY_MARGIN = 1.25

# From this many decode rows the Pallas kernels dequantize packed weights to bf16 before a
# cuBLAS dot (the autotune table's "dequant" mode, M > 64), every decode step. `generate`
# then dequantizes once per call instead (`dense_weights`), when the copies fit.
DENSE_FROM_ROWS = 65
# Below that, packed matrices of at most this many weights per layer also get bf16 copies:
# there the W4A16 kernel loses to a bf16 dot (launch-bound; H100: Qwen2.5-7B k/v, 512 x 3584,
# 0.48-0.65x and 32B k/v, 1024 x 5120, 0.71-0.77x at M <= 16, while 7B q/o, 3584 x 3584, is
# 0.9-1.4x; benchmarks/RESULTS.md table A3), and their copies are small (7B: 0.2 GB).
SMALL_DENSE_WEIGHTS = 6 * 2**20

# Up to this many decode rows, on a Hopper GPU with the "pallas" backend, the packed NVFP4
# projections that are not dense copies are repacked once per `generate` call for the Mosaic
# GPU wgmma kernel (pallas_kernels/wgmma_nvfp4.py; H100: 2.1-2.8x a bf16 dot on the 7B / 32B
# MLP shapes at M <= 16 and 1.2-2.2x at M = 64, 0.75-1.3x on q/o, against 0.9-1.3x for the Triton
# kernel; the 7B rollout step 1.5x bf16 at 64 rows with it, 0.96x without; RESULTS.md), q/k/v
# and gate/up concatenated into one call each (FUSABLE_PROJECTIONS; k/v then skip their copies).
WGMMA_MAX_ROWS = 64

# How many times each jitted program was traced (i.e. compiled), by name; for tests/logs.
TRACE_COUNTS: dict[str, int] = {"prefill": 0, "decode": 0}


@struct.dataclass
class RolloutBatch:
    """The output of `generate`; N = B * group_size rows, row b * G + g = sample g of prompt b.

    prompt_ids: int32 [N, P] left-padded prompts (P = the prompt bucket).
    prompt_mask: int32 [N, P] 1 on real prompt tokens.
    tokens: int32 [N, M] sampled response ids (M = max_new_tokens), pad_id after the stop.
    logprobs: float32 [N, M] log_softmax(logits / T) of each sampled token (before top-k/top-p
      truncation), 0 after the stop.
    response_mask: int32 [N, M] 1 up to and including the EOS/stop token.
    lengths: int32 [N] response lengths (EOS included).
    truncated: bool [N] True where no EOS/stop id came within max_new_tokens (always True with
      ignore_eos).
    prompt_index: int32 [N] the prompt (row of the input) each row was sampled from.
    steps: int32 [C] sampling steps run by each of the C sequential chunks (<= M; smaller when
      every row of the chunk stopped early).
    group_size: G (static).
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    response_mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    prompt_index: jax.Array
    steps: jax.Array
    group_size: int = struct.field(pytree_node=False, default=1)


def to_train_batch(batch: RolloutBatch, *, trim_to_multiple: int | None = None) -> dict[str, jax.Array]:
    """The train step's input: prompt (left-padded) then response (right-padded).

    Returns {"input_ids" int32 [N, T], "attention_mask" int32 [N, T], "response_mask" int32
    [N, T], "old_logp" float32 [N, T]} with T = P + M; old_logp[:, t] is the sampling log-prob
    of input_ids[:, t] (0 outside the response), i.e. it is predicted by the logits at t - 1.
    trim_to_multiple: drop response columns past the longest response, keeping a multiple of
    this many (fewer train-step shapes); None keeps all M columns.
    """
    tokens, logprobs, resp = batch.tokens, batch.logprobs, batch.response_mask
    if trim_to_multiple is not None:
        if trim_to_multiple < 1:
            raise ValueError(f"trim_to_multiple must be >= 1; got {trim_to_multiple}")
        longest = max(int(jnp.max(batch.lengths)), 1)
        width = min(tokens.shape[1], -(-longest // trim_to_multiple) * trim_to_multiple)
        tokens, logprobs, resp = tokens[:, :width], logprobs[:, :width], resp[:, :width]
    prompt_zeros = jnp.zeros_like(batch.prompt_mask)
    return {
        "input_ids": jnp.concatenate([batch.prompt_ids, tokens], axis=1),
        "attention_mask": jnp.concatenate([batch.prompt_mask, resp], axis=1),
        "response_mask": jnp.concatenate([prompt_zeros, resp], axis=1),
        "old_logp": jnp.concatenate([prompt_zeros.astype(jnp.float32), logprobs], axis=1),
    }


# ----------------------------------------------------------------------------- buckets


def prompt_bucket(n: int) -> int:
    """Padded prompt length: a power of two >= 16 up to 2048, then a multiple of 1024."""
    if n <= 2048:
        return max(16, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
    return -(-n // 1024) * 1024


def new_tokens_bucket(n: int) -> int:
    """Response buffer length: a multiple of 64."""
    return -(-n // 64) * 64


def rows_bucket(n: int) -> int:
    """Padded batch size: a power of two up to 8, then a multiple of 8."""
    return 1 << math.ceil(math.log2(n)) if n <= 8 else -(-n // 8) * 8


# ----------------------------------------------------------------------------- memory


def cache_bytes(config: ModelConfig, rows: int, slots: int, cache_dtype: Any = jnp.bfloat16) -> int:
    """Bytes of the K and V caches, each [L, rows, slots, KVH, head_dim]."""
    per_slot = config.num_key_value_heads * config.head_dim * jnp.dtype(cache_dtype).itemsize
    return 2 * config.num_hidden_layers * rows * slots * per_slot


def estimate_rollout_bytes(
    config: ModelConfig,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    cache_dtype: Any = jnp.bfloat16,
    *,
    num_prompts: int | None = None,
    act_dtype: Any = jnp.bfloat16,
    layer_copy_bytes: int = 0,
    stacked: bool = False,
) -> int:
    """Device bytes a rollout chunk allocates on top of the resident weights (an estimate).

    batch: sequences decoded together (rows); num_prompts: distinct prompts prefilled (default
    batch). Counts the KV cache of the decode (twice when `stacked`: a layer scan writes a new
    stack of caches while reading the old one), the prefill's prompt-sized cache and its
    largest activations (the MLP hidden and one layer's attention scores), the float32 logits
    work arrays of a decode step (logits, log-softmax, filtered logits, sampling noise), and
    `layer_copy_bytes`, the per-layer weight copies of the unrolled decode.
    """
    num_prompts = batch if num_prompts is None else num_prompts
    act = jnp.dtype(act_dtype).itemsize
    slots = prompt_len + max_new_tokens
    decode_cache = (2 if stacked else 1) * cache_bytes(config, batch, slots, cache_dtype)
    prefill_tokens = num_prompts * prompt_len
    prefill = (
        cache_bytes(config, num_prompts, prompt_len, cache_dtype)
        + cache_bytes(config, batch, slots, cache_dtype)  # the gathered/padded copy
        + prefill_tokens * (3 * config.intermediate_size + 4 * config.hidden_size) * act
        + 2 * num_prompts * config.num_attention_heads * prompt_len * prompt_len * 4
    )
    logits = 5 * batch * config.vocab_size * 4
    outputs = 4 * batch * max_new_tokens * 4
    return max(decode_cache, prefill) + logits + outputs + layer_copy_bytes


def device_free_bytes(device: jax.Device | None = None) -> int | None:
    """bytes_limit - bytes_in_use of the device, or None where the backend does not report it."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (some backends raise instead of returning None)
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


# ----------------------------------------------------------------------------- programs


def _split_layers(
    params: dict[str, Any],
    dense_backend: str | None = None,
    dense_names: tuple[str, ...] | None = None,
    wgmma_names: tuple[str, ...] = (),
) -> dict[str, Any]:
    """{"top": {...}, "packed": {proj: stacked PackedWeight}, "layers": [vars of layer l]}.

    dense_backend: "xla" | "pallas" to dequantize packed weights into per-layer bf16 copies
    (by that backend's dequantization, so the values are those of its per-step path) instead
    of reading them packed: those of `dense_names` (default all); None keeps them packed.
    wgmma_names: packed NVFP4 projections repacked per layer for the Hopper wgmma kernel
    (`pallas_kernels.wgmma_nvfp4.WgmmaWeight`, same values, same size); those that complete a
    group of FUSABLE_PROJECTIONS become one `Fused` weight under the group's `fused_name`.

    On GPU a layer `lax.scan` over stacked [L, ...] weights makes XLA copy each layer's slice
    before its matmul, every decode step (3x the weight traffic), and a stacked KV cache
    written through the scan is copied as well. Decoding layer by layer avoids both
    (measured on an H100, Qwen2.5-7B bf16: 15.3 -> 6.1 ms per step at B=1 and 59 -> 14.5 ms
    at B=256). Packed 4-bit weights stay stacked and are read in place (`LayerOf`: the
    Pallas kernel takes the layer index); the other layer variables (dense weights, biases,
    norms, LoRA) are copied into per-layer buffers once per `generate` call.
    """
    packed, copied = _packed_and_copied(params)
    top = {"embed": params["base"]["embed"], "final_norm": params["norms"]["final_norm"]}
    if "lm_head" in params["base"]:
        top["lm_head"] = params["base"]["lm_head"]
    act_dtype = _act_dtype(params).name
    layers = _layer_copies_jit(copied, act_dtype)
    to_dense = {n: w for n, w in packed.items() if dense_names is None or n in dense_names}
    if dense_backend is not None and to_dense:
        for layer, dense in enumerate(_dense_layers_jit(to_dense, dense_backend, act_dtype)):
            for name, w in dense.items():
                layers[layer]["base"][name]["w"] = w
        packed = {n: w for n, w in packed.items() if n not in to_dense}
    to_wgmma = {n: w for n, w in packed.items() if n in wgmma_names}
    if to_wgmma:
        # The stacks stay in "packed" (the prefill reads them in place); `_layer_vars` pairs
        # them with these copies. A reference to a whole stack in every layer's variables
        # instead made the decode loop copy the stacks every step (+1.1 ms, H100, 7B).
        for layer, repacked in enumerate(_wgmma_layers_jit(to_wgmma)):
            for name, w in repacked.items():
                layers[layer]["base"].setdefault(name, {})["w"] = w
        groups = fused_groups(tuple(to_wgmma))
        if groups and "lora" in copied:  # each fused call's adapters stacked once (`linear.stack_loras`)
            sizes = tuple(layers[0]["base"][fused_name(g)]["w"].sizes for g in groups)
            stacked = _stacked_loras_jit([layer["lora"] for layer in layers], tuple(zip(groups, sizes)))
            for layer, group_loras in zip(layers, stacked, strict=True):
                layer["lora"] = {**layer["lora"], **group_loras}
    return {"top": top, "packed": packed, "layers": layers}


def fused_groups(names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The groups of FUSABLE_PROJECTIONS all of whose projections are in `names`."""
    return tuple(g for g in FUSABLE_PROJECTIONS if set(g) <= set(names))


def _wgmma_layers(packed: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stacked NVFP4 weight repacked for the wgmma kernel, per layer {name: `WgmmaWeight`};
    the complete groups of FUSABLE_PROJECTIONS concatenated into {fused_name: `Fused`} instead."""
    from pallas_kernels import wgmma_nvfp4

    groups = fused_groups(tuple(packed))
    out = []
    for layer in _unstack(packed):
        repacked = {name: wgmma_nvfp4.from_packed(w) for name, w in layer.items()}
        for group in groups:
            ws = [repacked.pop(name) for name in group]
            fused = wgmma_nvfp4.concat(ws)
            repacked[fused_name(group)] = Fused(fused, tuple(w.shape[0] for w in ws), max_rows=wgmma_nvfp4.MAX_ROWS)
        out.append(repacked)
    return out


_wgmma_layers_jit = jax.jit(_wgmma_layers)


def _stacked_loras(layer_loras: list[dict[str, Any]], groups: tuple) -> list[dict[str, Any]]:
    """Per layer, {fused_name(group): the group's adapters stacked} for the ((names), sizes) in
    groups that have any adapter."""
    out = []
    for loras in layer_loras:
        stacked = {fused_name(g): stack_loras([loras.get(n) for n in g], sizes) for g, sizes in groups}
        out.append({name: lora for name, lora in stacked.items() if lora is not None})
    return out


_stacked_loras_jit = jax.jit(_stacked_loras, static_argnums=1)


def wgmma_weight_names(
    params: dict[str, Any],
    requested: bool | None,
    *,
    backend: str,
    rows: int,
    unroll_layers: bool,
    exclude: tuple[str, ...] = (),
    fits: Callable[[int], bool] = lambda extra: True,
    kernel_available: bool | None = None,
) -> tuple[str, ...]:
    """The packed projections `generate` repacks for the Hopper wgmma kernel (empty: none).

    requested None (auto): on backend "pallas" with unrolled layers, at most WGMMA_MAX_ROWS
    decode rows, the kernel available (`wgmma_nvfp4.available()`, or `kernel_available`) and
    the copies fitting `fits(bytes)`; True: wherever the kernel runs, whatever the rows; False:
    never. Only NVFP4 projections with N and K multiples of 64, not in `exclude` (dense copies),
    except that a group of FUSABLE_PROJECTIONS is taken whole when one of it is taken and all of it
    has the layout (one fused call beats a kernel call plus dense dots for the small k/v).
    """
    if requested is False or backend != "pallas" or not unroll_layers:
        return ()
    from pallas_kernels import wgmma_nvfp4

    if kernel_available is None:
        kernel_available = wgmma_nvfp4.available()
    if not kernel_available or (requested is None and rows > WGMMA_MAX_ROWS):
        return ()
    packed, _ = _packed_and_copied(params)
    fit = {n for n, w in packed.items() if wgmma_nvfp4.layout_fits(w.fmt, w.shape)}
    taken = {n for n in fit if n not in exclude}
    for group in fused_groups(tuple(fit)):
        if taken & set(group):
            taken |= set(group)
    names = tuple(sorted(taken))
    if requested is None and not fits(wgmma_copy_bytes(params, names)):
        return ()
    return names


def decode_weight_names(
    params: dict[str, Any],
    dense_weights: bool | None,
    wgmma_weights: bool | None,
    *,
    backend: str,
    rows: int,
    unroll_layers: bool,
    fits: Callable[[int], bool] = lambda extra: True,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`generate`'s choice of (projections read from bf16 copies, projections repacked for the
    wgmma kernel); `fits(bytes)` says whether copies of that size fit the memory budget.

    The bf16 copies are chosen first (`dense_weight_names`), then the wgmma copies among the rest
    (`wgmma_weight_names`); a small projection that completes a fused group goes to the kernel."""
    dense = dense_weight_names(
        params, dense_weights, backend=backend, rows=rows, unroll_layers=unroll_layers, fits=fits
    )
    dense_bytes = dense_copy_bytes(params, dense)
    wgmma = wgmma_weight_names(
        params,
        wgmma_weights,
        backend=backend,
        rows=rows,
        unroll_layers=unroll_layers,
        exclude=dense,
        fits=lambda extra: fits(dense_bytes + extra),
    )
    return tuple(n for n in dense if n not in wgmma), wgmma


def _nbytes(x: Any, dtype: Any = None) -> int:
    """Bytes of an array or of a `jax.ShapeDtypeStruct` (shape-only params, e.g. for `jax.eval_shape`),
    or of a copy of it in `dtype`."""
    return math.prod(x.shape) * jnp.dtype(x.dtype if dtype is None else dtype).itemsize


def _act_dtype(params: dict[str, Any]) -> np.dtype:
    """The activations' dtype: the embedding's (bf16 for a bf16 or 4-bit policy)."""
    return jnp.dtype(params["base"]["embed"].dtype)


def wgmma_copy_bytes(params: dict[str, Any], names: tuple[str, ...]) -> int:
    """Bytes of the repacked copies of `names` (as many as the packed codes and scales), plus the
    stacked adapters of their fused groups (`_stacked_loras`, in the activations' dtype)."""
    packed, copied = _packed_and_copied(params)
    total = sum(_nbytes(packed[n].codes) + _nbytes(packed[n].scales) for n in names)
    lora = copied.get("lora", {})
    act_size = _act_dtype(params).itemsize
    for group in fused_groups(names):
        adapters = [lora[n] for n in group if n in lora]
        if adapters:
            layers, rank_sum = adapters[0]["a"].shape[0], sum(a["a"].shape[1] for a in adapters)
            n_sum, k = sum(packed[n].shape[-2] for n in group), packed[group[0]].shape[-1]
            total += layers * rank_sum * (k + n_sum) * act_size
    return total


def _dense_layers(packed: dict[str, Any], backend: str, dtype: str) -> list[dict[str, jax.Array]]:
    """Each stacked packed weight dequantized, one [N, K] array per layer: bf16 by the Pallas
    dequantization kernel, or `dtype` (the activations') by `dequantize` for "xla"."""
    num_layers = next(iter(packed.values())).codes.shape[0]
    if backend == "pallas":
        import pallas_kernels  # only needed on this path

        deq = lambda stack, layer: pallas_kernels.dequantize_bf16(stack, layer=layer)  # noqa: E731
    else:
        deq = lambda stack, layer: dequantize(jax.tree.map(lambda a: a[layer], stack), dtype)  # noqa: E731
    return [{name: deq(stack, layer) for name, stack in packed.items()} for layer in range(num_layers)]


_dense_layers_jit = jax.jit(_dense_layers, static_argnums=(1, 2))


def use_dense_weights(
    requested: bool | None, *, backend: str, rows: int, dense_bytes: int, unroll_layers: bool, fits: bool
) -> bool:
    """`generate`'s choice of dense per-layer copies of the packed linears (see its docstring)."""
    if requested and not unroll_layers:
        raise ValueError("dense_weights=True needs unroll_layers=True (per-layer weight copies)")
    if requested is not None:
        return bool(requested) and dense_bytes > 0
    per_step_dequant = backend == "xla" or rows >= DENSE_FROM_ROWS
    return unroll_layers and dense_bytes > 0 and per_step_dequant and fits


def dense_copy_bytes(params: dict[str, Any], names: tuple[str, ...] | None = None) -> int:
    """Bytes of bf16 copies of the packed linears (of `names`, default all: what
    `generate(dense_weights=True)` adds; float32 activations double it on the XLA backend,
    which the estimate ignores)."""
    packed, _ = _packed_and_copied(params)
    # 2 weights per code byte, 2 bytes each
    return sum(4 * stack.codes.size for n, stack in packed.items() if names is None or n in names)


def dense_weight_names(
    params: dict[str, Any],
    requested: bool | None,
    *,
    backend: str,
    rows: int,
    unroll_layers: bool,
    fits: Callable[[int], bool],
) -> tuple[str, ...]:
    """The packed projections `generate` decodes from bf16 copies (empty: none); `fits(bytes)`
    says whether copies of that size fit the memory budget. See `generate`'s dense_weights."""
    all_bytes = dense_copy_bytes(params)
    if use_dense_weights(
        requested, backend=backend, rows=rows, dense_bytes=all_bytes, unroll_layers=unroll_layers, fits=fits(all_bytes)
    ):
        return tuple(sorted(_packed_and_copied(params)[0]))
    if requested is None and backend == "pallas" and unroll_layers:
        small = small_packed_names(params)
        if small and fits(dense_copy_bytes(params, small)):
            return small
    return ()


def small_packed_names(params: dict[str, Any]) -> tuple[str, ...]:
    """The packed projections of at most SMALL_DENSE_WEIGHTS weights per layer."""
    packed, _ = _packed_and_copied(params)
    return tuple(
        sorted(n for n, w in packed.items() if 2 * w.codes.shape[-2] * w.codes.shape[-1] <= SMALL_DENSE_WEIGHTS)
    )


def _packed_and_copied(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stacked layer variables split into ({proj: packed weight}, everything else)."""
    base_layers = params["base"]["layers"]
    packed = {name: p["w"] for name, p in base_layers.items() if is_packed(p["w"])}
    copied = {
        "base": {
            name: {f: v for f, v in p.items() if not (f == "w" and name in packed)} for name, p in base_layers.items()
        },
        "norms": params["norms"]["layers"],
    }
    if params.get("lora"):
        copied["lora"] = params["lora"]["layers"]
    return packed, copied


def layer_copy_bytes(params: dict[str, Any]) -> int:
    """Bytes of the per-layer copies `_split_layers` makes (all but the packed weights; LoRA in
    the activations' dtype, see `_layer_copies`)."""
    _, copied = _packed_and_copied(params)
    lora = copied.pop("lora", {})
    act_dtype = _act_dtype(params)
    return sum(_nbytes(x) for x in jax.tree.leaves(copied)) + sum(_nbytes(x, act_dtype) for x in jax.tree.leaves(lora))


def _layer_vars(params: dict[str, Any], layer: int) -> dict[str, Any]:
    """The variables of one layer: its copied buffers plus `LayerOf` views of the packed stacks."""
    vars_l = params["layers"][layer]
    if not params["packed"]:
        return vars_l
    index = jnp.int32(layer)
    base = {name: dict(p) for name, p in vars_l["base"].items()}
    for name, stack in params["packed"].items():
        if "w" in base[name]:  # a copy for the wgmma decode kernel: decode rows use it
            from pallas_kernels import wgmma_nvfp4

            base[name]["w"] = ByRows(base[name]["w"], LayerOf(stack, index), max_rows=wgmma_nvfp4.MAX_ROWS)
        else:
            base[name]["w"] = LayerOf(stack, index)
    return {**vars_l, "base": base}


def _unstack(stacked):
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    return [jax.tree.map(lambda x, i=layer: x[i], stacked) for layer in range(num_layers)]


def _layer_copies(copied: dict[str, Any], act_dtype: str) -> list[dict[str, Any]]:
    """Per-layer copies of the copied stacks, LoRA cast to the activations' dtype: the matmuls cast
    the adapters to it anyway, so a copy in it gives the same values while a decode step reads half
    the bytes of float32 adapters and runs no convert kernels (7B, rank 32: 56 per step at B = 16)."""
    if "lora" in copied:
        copied = {**copied, "lora": jax.tree.map(lambda a: a.astype(act_dtype), copied["lora"])}
    return _unstack(copied)


_layer_copies_jit = jax.jit(_layer_copies, static_argnums=1)


def _hidden(static, params, ids_BxT, positions_BxT, kv_valid_BxS, cache, cache_index):
    """Final normed hidden states [B, T, D] and the updated cache, stacked or layer by layer.

    Stacked (static.unroll False): params is the usual dict and cache (k, v) [L, B, S, KVH, hd],
    run by the model's own `Qwen2` module. Unrolled: params from `_split_layers` and cache a
    list of per-layer (k, v) [B, S, KVH, hd], each layer run by the model's `DecoderLayer`.
    """
    cfg = static.config
    if not static.unroll:
        return Qwen2(cfg, static.options).apply(
            variables(params),
            ids_BxT,
            positions_BxT,
            kv_valid_BxS,
            cache=cache,
            cache_index=cache_index,
            compute_logits=False,
        )
    h = jnp.take(params["top"]["embed"], ids_BxT, axis=0)
    new_cache = []
    for layer, cache_l in enumerate(cache):
        vars_l = _layer_vars(params, layer)
        h, cache_l = _layer_jit(cfg, static.options, vars_l, h, cache_l, positions_BxT, kv_valid_BxS, cache_index)
        new_cache.append(cache_l)
    return rms_norm(h, params["top"]["final_norm"], cfg.rms_norm_eps), new_cache


def _layer(config, options, vars_l, h, cache_l, positions_BxT, kv_valid_BxS, cache_index):
    return DecoderLayer(config, options).apply(vars_l, h, cache_l, positions_BxT, kv_valid_BxS, cache_index)


# A jit inside the programs: JAX traces and lowers the layer once and calls it L times (XLA
# inlines the calls), which keeps the compile time of the unrolled programs down, notably
# with Pallas kernels (one Triton lowering per kernel instead of one per layer).
_layer_jit = jax.jit(_layer, static_argnums=(0, 1))


def _lm_logits(static, params: dict[str, Any], h_BxD: jax.Array) -> jax.Array:
    """float32 [B, V] logits of final normed hidden states (the model's own head, one position)."""
    top = params["top"] if static.unroll else params["base"]
    head = top["embed"] if static.config.tie_word_embeddings else top["lm_head"]
    return jnp.einsum("bd,vd->bv", h_BxD, head.astype(h_BxD.dtype), preferred_element_type=jnp.float32)


def _sequence_keys(key: jax.Array, seq_ids_R: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, seq_ids_R)


def _step_keys(seq_keys_R: jax.Array, step: jax.Array | int) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(seq_keys_R, step)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the compiled programs are specialised on (besides array shapes).

    Only the fields of `sampling` that change the drawing are kept (max_new_tokens, stop ids
    and pad id are runtime arguments), so they do not cause recompiles.
    """

    config: ModelConfig
    sampling: SamplingConfig
    options: ForwardOptions
    new_slots: int  # the new-token bucket M_b; cache slots S = P_b + M_b
    cache_dtype: str
    unroll: bool = True


def _prefill(static: _Static, params, ids_BxP, mask_BxP, rows_R, key, seq_ids_R):
    """Prefill B prompts, expand to R rows (rows_R indexes the prompts), sample the first token.

    seq_ids_R: each row's index in the whole rollout, for its PRNG key.
    Returns (cache, tokens [R], logps [R]); the cache holds P + M_b slots per row (see `_hidden`).
    """
    TRACE_COUNTS["prefill"] += 1
    cfg = static.config
    b, p = ids_BxP.shape
    layer_shape = (b, p, cfg.num_key_value_heads, cfg.head_dim)
    if static.unroll:
        cache = [(jnp.zeros(layer_shape, static.cache_dtype),) * 2 for _ in range(cfg.num_hidden_layers)]
    else:
        cache = (jnp.zeros((cfg.num_hidden_layers, *layer_shape), static.cache_dtype),) * 2
    h_BxPxD, cache = _hidden(static, params, ids_BxP, positions_from_mask(mask_BxP), mask_BxP.astype(bool), cache, 0)
    logits_BxV = _lm_logits(static, params, h_BxPxD[:, -1])
    batch_axis = 0 if static.unroll else 1

    def expand(c):  # room for the new tokens, then one row per sequence (the gather writes the output)
        pad = [(0, 0)] * c.ndim
        pad[batch_axis + 1] = (0, static.new_slots)
        return jnp.take(jnp.pad(c, pad), rows_R, axis=batch_axis)

    cache = jax.tree.map(expand, cache)
    keys_R = _step_keys(_sequence_keys(key, seq_ids_R), 0)
    tokens_R, logp_R = sample(keys_R, jnp.take(logits_BxV, rows_R, axis=0), static.sampling)
    return cache, tokens_R, logp_R


def _decode(
    static: _Static,
    params,
    cache,
    first_R,
    first_logp_R,
    mask_BxP,
    rows_R,
    key,
    seq_ids_R,
    active_R,
    max_new,
    stop_V,
    pad_id,
):
    """The decode loop. Returns (tokens [R, M_b], logps [R, M_b], lengths [R], stopped [R], steps, cache).

    stop_V: bool [V], which ids end a row; pad_id: int32 written after the stop; max_new: int32.
    The cache is returned (and dropped by the caller) so that XLA can alias it with the donated
    input buffer and run the loop in place instead of copying it first.
    """
    TRACE_COUNTS["decode"] += 1
    sampling = static.sampling
    mask_RxP = jnp.take(mask_BxP, rows_R, axis=0)
    r, p = mask_RxP.shape
    m = static.new_slots
    seq_keys_R = _sequence_keys(key, seq_ids_R)
    prompt_len_R = jnp.sum(mask_RxP, axis=1, dtype=jnp.int32)
    kv_valid_RxS = jnp.concatenate([mask_RxP.astype(bool), jnp.ones((r, m), bool)], axis=1)

    first_R = jnp.where(active_R, first_R, pad_id)
    stopped_R = stop_V[first_R] & active_R
    tokens_RxM = jnp.full((r, m), pad_id, jnp.int32).at[:, 0].set(first_R)
    logp_RxM = jnp.zeros((r, m), jnp.float32).at[:, 0].set(jnp.where(active_R, first_logp_R, 0.0))
    lengths_R = jnp.where(active_R, jnp.where(stopped_R, 1, max_new), 0).astype(jnp.int32)
    init = (jnp.int32(1), cache, first_R, tokens_RxM, logp_RxM, stopped_R | ~active_R, lengths_R, stopped_R)

    def cond(state):
        step, _, _, _, _, done_R, _, _ = state
        return (step < max_new) & ~jnp.all(done_R)

    def body(state):
        step, cache, last_R, tokens_RxM, logp_RxM, done_R, lengths_R, stopped_R = state
        h_Rx1xD, cache = _hidden(
            static, params, last_R[:, None], (prompt_len_R + step - 1)[:, None], kv_valid_RxS, cache, p + step - 1
        )
        logits_RxV = _lm_logits(static, params, h_Rx1xD[:, 0])
        new_R, logp_R = sample(_step_keys(seq_keys_R, step), logits_RxV, sampling)
        new_R = jnp.where(done_R, pad_id, new_R)
        logp_R = jnp.where(done_R, 0.0, logp_R)
        tokens_RxM = jax.lax.dynamic_update_slice(tokens_RxM, new_R[:, None], (0, step))
        logp_RxM = jax.lax.dynamic_update_slice(logp_RxM, logp_R[:, None], (0, step))
        hit_R = stop_V[new_R] & ~done_R
        lengths_R = jnp.where(hit_R, step + 1, lengths_R)
        return step + 1, cache, new_R, tokens_RxM, logp_RxM, done_R | hit_R, lengths_R, stopped_R | hit_R

    steps, cache, _, tokens_RxM, logp_RxM, _, lengths_R, stopped_R = jax.lax.while_loop(cond, body, init)
    return tokens_RxM, logp_RxM, lengths_R, stopped_R, steps, cache


def _assemble(chunks, prompt_ids_BxP, prompt_mask_BxP, *, rows: tuple[int, ...], max_new: int, group_size: int):
    """Chunk outputs (padded rows and new-token bucket) -> the RolloutBatch fields."""
    cat = lambda i: jnp.concatenate([c[i][:n] for c, n in zip(chunks, rows)])  # noqa: E731
    tokens, logprobs, lengths = cat(0)[:, :max_new], cat(1)[:, :max_new], cat(2)
    prompt_index = jnp.arange(sum(rows), dtype=jnp.int32) // group_size
    return dict(
        prompt_ids=prompt_ids_BxP[prompt_index],
        prompt_mask=prompt_mask_BxP[prompt_index],
        tokens=tokens,
        logprobs=logprobs,
        response_mask=(jnp.arange(max_new)[None, :] < lengths[:, None]).astype(jnp.int32),
        lengths=lengths,
        truncated=~cat(3),
        prompt_index=prompt_index,
        steps=jnp.stack([c[4] for c in chunks]).astype(jnp.int32),
    )


_prefill_jit = jax.jit(_prefill, static_argnums=0)
_decode_jit = jax.jit(_decode, static_argnums=0, donate_argnums=2)
_assemble_jit = jax.jit(_assemble, static_argnames=("rows", "max_new", "group_size"))


# ----------------------------------------------------------------------------- driver


def _check_prompts(config: ModelConfig, ids: np.ndarray, mask: np.ndarray, max_new: int) -> np.ndarray:
    """Validates left-padded prompts; returns the int32 [B] prompt lengths."""
    if ids.ndim != 2:
        raise ValueError(f"prompt_ids must be [batch, prompt_len]; got shape {ids.shape}")
    if mask.shape != ids.shape:
        raise ValueError(f"prompt_mask shape {mask.shape} != prompt_ids shape {ids.shape}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids is empty (shape {ids.shape}); expected at least one prompt token")
    if not np.all((mask == 0) | (mask == 1)):
        raise ValueError("prompt_mask must hold only 0 (padding) and 1 (real token)")
    lengths = mask.sum(axis=1).astype(np.int32)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"prompt row(s) {empty.tolist()} have no real token (prompt_mask all 0); drop them")
    not_left = np.flatnonzero(np.any(np.diff(mask, axis=1) < 0, axis=1))
    if not_left.size:
        raise ValueError(
            f"prompt row(s) {not_left.tolist()} are not left-padded: the mask must be 0...0 1...1 (pad on the left)"
        )
    if np.any((ids < 0) | (ids >= config.vocab_size)):
        bad = ids[(ids < 0) | (ids >= config.vocab_size)][:5]
        raise ValueError(f"prompt_ids hold ids outside [0, vocab_size={config.vocab_size}): {bad.tolist()}")
    longest = int(lengths.max())
    if longest + max_new > config.max_position_embeddings:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({max_new}) exceeds the model's "
            f"max_position_embeddings ({config.max_position_embeddings}); shorten the prompt or max_new_tokens"
        )
    return lengths


def _row_shards(batch_sharding: jax.sharding.Sharding | None) -> int:
    """Into how many pieces `batch_sharding` splits a leading axis (1 for None)."""
    if batch_sharding is None:
        return 1
    probe = batch_sharding.num_devices  # a length the shard count divides, whatever the mesh
    return probe // batch_sharding.shard_shape((probe,))[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _chunks(num_prompts: int, group_size: int, max_batch: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) row ranges of at most max_batch rows; whole groups when they fit."""
    total = num_prompts * group_size
    per_chunk = (max_batch // group_size) * group_size if group_size <= max_batch else max_batch
    return [(s, min(s + per_chunk, total)) for s in range(0, total, per_chunk)]


def generate(
    config: ModelConfig,
    params: dict[str, Any],
    prompt_ids: jax.Array | np.ndarray,
    prompt_mask: jax.Array | np.ndarray,
    key: jax.Array,
    sampling: SamplingConfig,
    *,
    group_size: int = 1,
    lora_scale: float = 1.0,
    backend: str = "xla",
    cache_dtype: Any = jnp.bfloat16,
    max_batch: int | None = None,
    memory_budget_bytes: int | None = None,
    share_prefill: bool = True,
    cache_new_tokens: int | None = None,
    timings: dict[str, float] | None = None,
    unroll_layers: bool = True,
    batch_sharding: jax.sharding.Sharding | None = None,
    dense_weights: bool | None = None,
    wgmma_weights: bool | None = None,
) -> RolloutBatch:
    """Samples group_size responses for each of B left-padded prompts.

    Args:
      config, params: the policy ({"base", "norms", optional "lora"}); linears may be dense or
        packed 4-bit, the LoRA delta is added unmerged with `lora_scale`.
      prompt_ids, prompt_mask: int [B, P], left-padded (mask 0...0 1...1 per row).
      key: PRNG key; see the module docstring for how per-row keys derive from it.
      sampling: temperature/top-p/top-k/greedy, max_new_tokens, stop ids.
      group_size: G samples per prompt; the output has B * G rows, prompt-major.
      backend: the linear backend, "xla" or "pallas".
      cache_dtype: KV cache dtype (bfloat16; float32 for exactness tests).
      max_batch: at most this many rows are decoded at once (sequential chunks); default all.
      memory_budget_bytes: device bytes a chunk may use; default the device's free memory when
        the backend reports it (GPU/TPU), else unchecked.
      share_prefill: prefill each prompt once and copy its cache to its G rows (default); False
        prefills the B * G repeated prompts (same results, for benchmarking the gain).
      cache_new_tokens: new-token slots to allocate (>= max_new_tokens; default its bucket), e.g.
        to time a few decode steps at the cache size of a longer rollout.
      timings: if a dict, the per-layer weight copies, the prefill and the decode of every chunk
        are waited for and their wall-clock seconds are added under "unstack_s", "prefill_s" and
        "decode_s" (and the sampling steps under "steps").
      unroll_layers: run the layers one by one (packed weights read in place, dense weights,
        norms and LoRA over per-layer copies made for this call: +1x those in memory) with
        per-layer caches (default; 2.5-4x faster decode on GPU, see `_split_layers`); False
        runs the model's layer scan as is.
      batch_sharding: a sharding of the leading (row) axis, e.g. NamedSharding(mesh, P("data")),
        for data-parallel rollouts: each chunk's prompt and row arrays are placed with it (row
        buckets rounded up to a multiple of its shard count) and jit propagates it to the KV
        cache and the samples. Place the params first (replicated, or `sharding.shard_params`).
        The samples equal those of one device (per-row keys).
      dense_weights: dequantize the packed linears to bf16 once for this call and decode with
        the dense copies (+2 bytes per weight in memory while it runs). None (default) does so
        where the per-step path would dequantize anyway (backend "xla", or "pallas" with at
        least DENSE_FROM_ROWS decode rows) and the copies fit in the memory budget; below
        that, on "pallas", only for the small projections (SMALL_DENSE_WEIGHTS), where the
        kernel is slower than a bf16 dot, unless the wgmma kernel runs them fused with a larger
        one (k/v with q). Unrolled layers only.
      wgmma_weights: repack the other NVFP4 projections once for this call for the Hopper
        wgmma decode kernel (+4.5 bits per weight while it runs); None (default) does so on a
        Hopper GPU with backend "pallas", unrolled layers and at most WGMMA_MAX_ROWS decode
        rows, when the copies fit; False never (the Triton kernel reads them in place). The copies
        of q/k/v and of gate/up are concatenated per layer and run as one call each.
    Returns:
      A `RolloutBatch` with N = B * G rows and M = max_new_tokens response columns.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 or None; got {max_batch}")
    ids_np = np.asarray(prompt_ids)
    mask_np = np.asarray(prompt_mask)
    lengths = _check_prompts(config, ids_np, mask_np, sampling.max_new_tokens)
    ids_np, mask_np = ids_np.astype(np.int32), mask_np.astype(np.int32)

    num_prompts = ids_np.shape[0]
    p_b = prompt_bucket(int(lengths.max()))
    width = ids_np.shape[1]
    if width >= p_b:  # drop leading columns that are padding in every row
        ids_np, mask_np = ids_np[:, width - p_b :], mask_np[:, width - p_b :]
    else:
        ids_np = np.pad(ids_np, ((0, 0), (p_b - width, 0)))
        mask_np = np.pad(mask_np, ((0, 0), (p_b - width, 0)))

    stop_ids = () if sampling.ignore_eos else (config.eos_token_id if sampling.eos_ids is None else sampling.eos_ids)
    pad_id = sampling.pad_id if sampling.pad_id is not None else (config.pad_token_id or 0)
    bad_ids = [i for i in (*stop_ids, pad_id) if not 0 <= i < config.vocab_size]
    if bad_ids:
        raise ValueError(f"stop/pad ids {bad_ids} are outside [0, vocab_size={config.vocab_size})")
    new_slots = new_tokens_bucket(sampling.max_new_tokens) if cache_new_tokens is None else int(cache_new_tokens)
    if new_slots < sampling.max_new_tokens:
        raise ValueError(f"cache_new_tokens ({cache_new_tokens}) must be >= max_new_tokens ({sampling.max_new_tokens})")
    stop_V = np.zeros((config.vocab_size,), bool)
    stop_V[list(stop_ids)] = True
    static = _Static(
        config=config,
        sampling=SamplingConfig(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, greedy=sampling.greedy
        ),
        options=ForwardOptions(lora_scale=float(lora_scale), backend=backend),
        new_slots=new_slots,
        cache_dtype=jnp.dtype(cache_dtype).name,
        unroll=unroll_layers,
    )

    total = num_prompts * group_size
    chunks = _chunks(num_prompts, group_size, max_batch or total)
    rows_b = rows_bucket(max(stop - start for start, stop in chunks))
    prompts_per_chunk = [((stop - 1) // group_size) - (start // group_size) + 1 for start, stop in chunks]
    prompts_b = rows_b if not share_prefill else rows_bucket(max(prompts_per_chunk))
    shards = _row_shards(batch_sharding)
    rows_b, prompts_b = _round_up(rows_b, shards), _round_up(prompts_b, shards)
    put = (lambda a: a) if batch_sharding is None else (lambda a: jax.device_put(a, batch_sharding))

    need = estimate_rollout_bytes(
        config,
        rows_b,
        p_b,
        static.new_slots,
        cache_dtype,
        num_prompts=prompts_b,
        act_dtype=_act_dtype(params),
        stacked=not unroll_layers,
        layer_copy_bytes=layer_copy_bytes(params) if unroll_layers else 0,
    )
    budget = memory_budget_bytes if memory_budget_bytes is not None else device_free_bytes()
    dense_names, wgmma_names = decode_weight_names(
        params,
        dense_weights,
        wgmma_weights,
        backend=backend,
        rows=rows_b,
        unroll_layers=unroll_layers,
        fits=lambda extra: budget is None or (need + extra) * MEMORY_MARGIN <= budget,
    )
    dense_bytes = dense_copy_bytes(params, dense_names)
    need += dense_bytes + wgmma_copy_bytes(params, wgmma_names)
    if budget is not None and need * MEMORY_MARGIN > budget:
        raise MemoryError(
            f"rollout chunk of {rows_b} sequences x ({p_b} prompt + {static.new_slots} new) slots needs about "
            f"{need / 2**30:.2f} GiB (x{MEMORY_MARGIN} margin), over the {budget / 2**30:.2f} GiB budget; lower "
            f"max_batch (rollout chunk size, now {max_batch}), the group size ({group_size}), the prompt batch "
            f"({num_prompts}) or "
            f"max_new_tokens ({sampling.max_new_tokens})"
            + (f", or pass dense_weights=False ({dense_bytes / 2**30:.2f} GiB of bf16 copies)" if dense_names else "")
        )

    t0 = time.perf_counter()
    if unroll_layers:
        run_params = _split_layers(params, backend if dense_names else None, dense_names or None, wgmma_names)
    else:
        run_params = params
    if timings is not None:
        jax.block_until_ready(run_params)
        timings["unstack_s"] = timings.get("unstack_s", 0.0) + time.perf_counter() - t0
    # A filler prompt for padded rows: one real (pad) token, so no row is fully masked.
    filler_ids = np.zeros((p_b,), np.int32)
    filler_mask = np.zeros((p_b,), np.int32)
    filler_mask[-1] = 1
    outs, rows_per_chunk = [], []
    for start, stop in chunks:
        n = stop - start
        prompt_of_row = np.arange(start, stop) // group_size
        if share_prefill:
            chunk_prompts = np.arange(prompt_of_row[0], prompt_of_row[-1] + 1)
            rows = prompt_of_row - prompt_of_row[0]
        else:
            chunk_prompts, rows = prompt_of_row, np.arange(n)
        ids_c = np.tile(filler_ids, (prompts_b, 1))
        mask_c = np.tile(filler_mask, (prompts_b, 1))
        ids_c[: len(chunk_prompts)] = ids_np[chunk_prompts]
        mask_c[: len(chunk_prompts)] = mask_np[chunk_prompts]
        rows_c = np.zeros((rows_b,), np.int32)
        rows_c[:n] = rows
        seq_ids = np.minimum(np.arange(rows_b) + start, total - 1).astype(np.uint32)
        ids_c, mask_c, rows_c, seq_ids = map(put, (ids_c, mask_c, rows_c, seq_ids))
        t0 = time.perf_counter()
        cache, first, first_logp = _prefill_jit(static, run_params, ids_c, mask_c, rows_c, key, seq_ids)
        if timings is not None:
            jax.block_until_ready(first)
            t1 = time.perf_counter()
            timings["prefill_s"] = timings.get("prefill_s", 0.0) + t1 - t0
        *out, cache = _decode_jit(
            static,
            run_params,
            cache,
            first,
            first_logp,
            mask_c,
            rows_c,
            key,
            seq_ids,
            put(np.arange(rows_b) < n),
            np.int32(sampling.max_new_tokens),
            stop_V,
            np.int32(pad_id),
        )
        del cache  # free it before the next chunk's prefill allocates another
        if timings is not None:
            jax.block_until_ready(out)
            timings["decode_s"] = timings.get("decode_s", 0.0) + time.perf_counter() - t1
            timings["steps"] = timings.get("steps", 0) + int(out[4])
        outs.append(tuple(out))
        rows_per_chunk.append(n)
    fields = _assemble_jit(
        outs, ids_np, mask_np, rows=tuple(rows_per_chunk), max_new=sampling.max_new_tokens, group_size=group_size
    )
    return RolloutBatch(**fields, group_size=group_size)
