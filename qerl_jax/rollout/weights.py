"""The policy's weights as the rollout's programs read them, prepared once per `generate` call.

    run_params = split_layers(params, dense_backend, dense_names, wgmma_names)
    vars_l = layer_vars(run_params, layer)  # one layer's variables for the model's DecoderLayer

- Per-layer copies of every stacked layer variable except packed 4-bit weights (which stay
  stacked and are read in place, `LayerOf`), LoRA adapters in the activations' dtype.
- Optional bf16 copies of packed projections (`dense_names`): the per-step path would
  dequantize them anyway (XLA, or the Pallas kernels above 64 rows), or they are small.
- Optional copies of NVFP4 projections repacked for the Hopper wgmma decode kernel
  (`wgmma_names`), q/k/v and gate/up concatenated into one call each (`Fused`; a `Fused` of one
  for the others), their LoRA adapters stacked (`linear.stack_loras`). A decode program of at most `wgmma_nvfp4.MAX_ROWS`
  rows runs these; larger ones (and the prefill) read the bf16 copy or the packed stack
  (`ByRows`), so one call can decode a large row bucket on bf16 copies and, once its rows are
  compacted, the small buckets on the kernel.
- Dense weights (a bf16 policy's, or the bf16 copies) of q/k/v and of gate/up concatenated the
  same way (`dense_fused_groups`), their adapters stacked, and the stacked A below the weight's
  rows (`Fused.lora_rows`), as each dense o_proj and down_proj gets its adapter's A: with LoRA,
  2 dots instead of 9 for q/k/v, 2 instead of 6 for gate/up and 2 instead of 3 for o and down in
  every layer of every step (a 1.5B decode step is ~700-1200 small kernels, so their number sets
  its time; `benchmarks/RESULTS.md`).

`decode_weight_names` chooses the copies for a call from its row buckets, the model's size and the
memory budget;
`layer_copy_bytes`, `dense_copy_bytes`, `wgmma_copy_bytes` and `fused_lora_bytes` are their sizes
(for the estimate).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import fp8
from qerl_jax.linear import ByRows, Fused, LayerOf, stack_loras
from qerl_jax.models.qwen2 import fused_name
from qerl_jax.projections import FUSED_GROUPS, PROJECTIONS
from qerl_jax.quant.packed import dequantize, is_packed

# The projections outside FUSED_GROUPS: a dense one alone becomes a `Fused` holding its adapter's A.
UNGROUPED = tuple(n for n in PROJECTIONS if not any(n in g for g in FUSED_GROUPS))

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
# projections are repacked once per `generate` call for the Mosaic GPU wgmma kernel
# (pallas_kernels/wgmma_nvfp4.py; H100: 2.1-2.8x a bf16 dot on the 7B / 32B MLP shapes at
# M <= 16 and 1.2-2.2x at M = 64, 0.75-1.3x on q/o, against 0.9-1.3x for the Triton kernel; the
# 7B rollout step 1.5x bf16 at 64 rows with it, 0.96x without; RESULTS.md), q/k/v and gate/up
# concatenated into one call each (FUSED_GROUPS; k/v then skip their small copies).
WGMMA_MAX_ROWS = 64

# A model whose layers hold fewer packed weights than this decodes from bf16 copies of them all
# (when they fit), with neither kernel, by default. Its decode step is bound by its chain of small
# kernels, not by reading weights, and a Mosaic GPU kernel compiles in every process (when a
# program loads, outside JAX's persistent cache). H200, 1.5B (47M weights a layer), the claims
# rollout of 128 rows at 768 tokens: warm 2.28-2.38 s with the kernel on the MLP at <= 64 rows,
# 2.31 s from the copies; first call 21.4-30.0 s against 20.6 s. The 7B (233M a layer) gains
# 1.5x at 64 rows from the kernel. Between them (3B: 77M) it is not measured.
KERNEL_MIN_LAYER_WEIGHTS = 128 * 2**20

# `Fused.max_rows` of the dense concatenations: they serve every matmul (decode and prefill).
ANY_ROWS = 2**62


def split_layers(
    params: dict[str, Any],
    dense_backend: str | None = None,
    dense_names: tuple[str, ...] | None = None,
    wgmma_names: tuple[str, ...] = (),
    fp8_min_rows: int | None = None,
) -> dict[str, Any]:
    """{"top": {...}, "packed": {proj: stacked PackedWeight}, "layers": [vars of layer l]}.

    dense_backend: "xla" | "pallas" to dequantize packed weights into per-layer bf16 copies
    (by that backend's dequantization, so the values are those of its per-step path) instead
    of reading them packed: those of `dense_names` (default all); None keeps them packed.
    wgmma_names: packed NVFP4 projections repacked per layer for the Hopper wgmma kernel
    (`pallas_kernels.wgmma_nvfp4.WgmmaWeight`, same values, same size); those that complete a
    group of FUSED_GROUPS become one `Fused` weight under the group's `fused_name`, the others a
    `Fused` of one projection (their adapters then run as a fused call's, `linear.fused_linear`). A
    projection with both copies reads the repacked one up to the kernel's rows, else the bf16 one.
    fp8_min_rows: every dense layer weight (bf16 copies, concatenations) also gets an E4M3 copy
    (`fp8.Fp8Weight`, `add_fp8_copies`) that matmuls of at least this many rows read; None: none.

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
    act_dtype = act_dtype_of(params).name
    layers = _layer_copies_jit(copied, act_dtype)
    to_wgmma = {n: w for n, w in packed.items() if n in wgmma_names}
    to_dense = {n: w for n, w in packed.items() if dense_names is None or n in dense_names}
    if dense_backend is not None and to_dense:
        for layer, dense in enumerate(_each_layer(_dense_layer_jit, to_dense, dense_backend, act_dtype)):
            for name, w in dense.items():
                layers[layer]["base"][name]["w"] = w
        packed = {n: w for n, w in packed.items() if n not in to_dense}
    if to_wgmma:
        from pallas_kernels import wgmma_nvfp4

        # Those still packed stay in "packed" (the prefill reads them in place); `layer_vars`
        # pairs them with these copies. A reference to a whole stack in every layer's variables
        # instead made the decode loop copy the stacks every step (+1.1 ms, H100, 7B).
        for layer, repacked in enumerate(_each_layer(_wgmma_layer_jit, to_wgmma)):
            for name, w in repacked.items():
                entry = layers[layer]["base"].setdefault(name, {})
                entry["w"] = ByRows(w, entry["w"], max_rows=wgmma_nvfp4.MAX_ROWS) if "w" in entry else w
        groups = fused_groups(tuple(to_wgmma))
        _add_stacked_loras(layers, groups, {g: layers[0]["base"][fused_name(g)]["w"].sizes for g in groups})
    _fuse_dense_groups(layers, dense_fused_groups(params, tuple(to_dense) if dense_backend is not None else ()))
    if fp8_min_rows is not None:
        add_fp8_copies(layers, fp8_min_rows)
    return {"top": top, "packed": packed, "layers": layers}


def _fp8_source(w: Any) -> Fused | jax.Array | None:
    """The dense layout a rollout weight computes with above the kernel's rows (a dense `Fused`
    or array), which `add_fp8_copies` copies to E4M3; None for a packed or kernel-only one."""
    large = w.large if isinstance(w, ByRows) else w
    if isinstance(large, Fused) and isinstance(large.w, jax.Array):
        return large
    return large if isinstance(large, jax.Array) and large.ndim == 2 else None


def add_fp8_copies(layers: list[dict[str, Any]], min_rows: int) -> None:
    """In place, per layer: each dense weight (`_fp8_source`) as `ByRows` of itself up to
    min_rows - 1 rows and its E4M3 copy above (a `Fused` copy of the base rows only: the adapters'
    A folded below them (`Fused.lora_rows`) stay out of FP8, their matmul runs apart)."""
    names = [n for n, p in layers[0]["base"].items() if "w" in p and _fp8_source(p["w"]) is not None]
    for layer in layers:
        base = layer["base"]
        sources = {n: _fp8_source(base[n]["w"]) for n in names}
        dense = {n: (s.w[: sum(s.sizes)] if isinstance(s, Fused) else s) for n, s in sources.items()}
        copies = _fp8_layer_jit(dense)
        for n, src in sources.items():
            large = Fused(copies[n], src.sizes, max_rows=ANY_ROWS) if isinstance(src, Fused) else copies[n]
            base[n]["w"] = ByRows(base[n]["w"], large, max_rows=min_rows - 1)


_fp8_layer_jit = jax.jit(lambda dense: {n: fp8.from_dense(w) for n, w in dense.items()})


def fp8_copy_bytes(params: dict[str, Any], dense_names: tuple[str, ...]) -> int:
    """Bytes of the E4M3 copies `add_fp8_copies` makes: one byte a weight plus a float32 scale per
    output channel, of the packed projections with bf16 copies (`dense_names`) and the dense ones."""
    base_layers = params["base"]["layers"]
    total = 0
    for name, p in base_layers.items():
        if is_packed(p["w"]) and name not in dense_names:
            continue
        *lead, n, k = device_shape(p["w"].codes) if is_packed(p["w"]) else device_shape(p["w"])
        total += fp8.copy_bytes((*lead, n, 2 * k if is_packed(p["w"]) else k))
    return total


def dense_fused_groups(params: dict[str, Any], dense_names: tuple[str, ...] = ()) -> tuple[tuple[str, ...], ...]:
    """The groups of FUSED_GROUPS that `split_layers` concatenates as dense weights: those all of
    whose projections are dense (unpacked, or packed with a bf16 copy in `dense_names`) and not
    sharded over several devices (a concatenation of column-parallel shards would regroup them)."""
    base_layers = params["base"]["layers"]
    dense = {n for n, p in base_layers.items() if n in dense_names or not is_packed(p["w"])}
    return tuple(
        g for g in fused_groups(tuple(dense)) if all(_on_one_device(base_layers[n]["w"]) for n in g)
    )


def _on_one_device(w: Any) -> bool:
    sharding = getattr(getattr(w, "codes", w), "sharding", None)  # a packed weight's codes; None: traced
    return sharding is None or len(sharding.device_set) == 1 or sharding.is_fully_replicated


def _fuse_dense_groups(layers: list[dict[str, Any]], groups: tuple[tuple[str, ...], ...]) -> None:
    """In place, per layer: each group's dense weights concatenated into one `Fused` under its
    `fused_name` (the members keep their biases), beside the group's wgmma copy where there is one
    (`ByRows`: the kernel's `Fused` up to its rows), and the group's adapters stacked once. Where a
    group has adapters, their stacked A goes below its dense rows (`Fused.lora_rows`), and so does
    the adapter of each dense projection outside the groups (o_proj, down_proj): the adapters' first
    matmul rides on the base one, a matmul fewer per projection group in every step."""
    # Group members with a layout of their own (a lone wgmma copy, `ByRows`) stay as they are; every layer alike.
    first = layers[0]["base"]
    adapters = layers[0].get("lora", {})
    groups = tuple(g for g in groups if all(isinstance(first[n].get("w"), jax.Array) for n in g))
    singles = tuple(
        (n,) for n in UNGROUPED
        if n in adapters and (w := _dense_part(first[n].get("w"))) is not None and _on_one_device(w)
        and adapters[n]["a"].dtype == w.dtype
    )  # fmt: skip
    if not groups and not singles:
        return
    sizes = {g: tuple(_dense_part(first[n]["w"]).shape[0] for n in g) for g in groups + singles}
    _add_stacked_loras(layers, tuple(g for g in groups if fused_name(g) not in adapters), sizes)
    for layer in layers:
        base, stacked = layer["base"], layer.get("lora", {})
        for group in groups + singles:
            name = fused_name(group)
            kernel = base[name]["w"] if len(group) > 1 and "w" in base.get(name, {}) else None  # its wgmma `Fused`
            ws = [base[n].pop("w") for n in group]
            if isinstance(ws[0], ByRows):  # a projection alone: its wgmma copy up to the kernel's rows
                kernel, ws = ws[0], [ws[0].large]
            a = stacked[name]["a"] if name in stacked else None
            a = a if a is not None and a.dtype == ws[0].dtype else None  # a wider A would widen the weight
            rows = 0 if a is None else a.shape[0]
            w = Fused(_concat_jit((*ws, a) if rows else tuple(ws)), sizes[group], max_rows=ANY_ROWS, lora_rows=rows)
            if kernel is not None:
                small = kernel.small if isinstance(kernel, ByRows) else kernel
                w = ByRows(small, w, max_rows=kernel.max_rows)
            base.setdefault(name, {})["w"] = w


def _dense_part(w: Any) -> jax.Array | None:
    """The dense array a projection's rollout weight computes with above the kernel's rows: the
    weight itself, or a `ByRows`' large layout, where it is a dense array; else None."""
    if isinstance(w, ByRows):
        w = w.large
    return w if isinstance(w, jax.Array) else None


def _add_stacked_loras(
    layers: list[dict[str, Any]], groups: tuple[tuple[str, ...], ...], sizes: dict[tuple[str, ...], tuple[int, ...]]
) -> None:
    """In place: each fused group's adapters stacked once per call (`linear.stack_loras`) under
    its `fused_name`, for projections of out sizes `sizes[group]`."""
    if not groups or "lora" not in layers[0]:
        return
    stacked = _stacked_loras_jit([layer["lora"] for layer in layers], tuple((g, sizes[g]) for g in groups))
    for layer, group_loras in zip(layers, stacked, strict=True):
        layer["lora"] = {**layer["lora"], **group_loras}


_concat_jit = jax.jit(lambda ws: jnp.concatenate(ws, axis=0))


def layer_vars(run_params: dict[str, Any], layer: int) -> dict[str, Any]:
    """The variables of one layer: its copied buffers plus `LayerOf` views of the packed stacks."""
    vars_l = run_params["layers"][layer]
    if not run_params["packed"]:
        return vars_l
    index = jnp.int32(layer)
    base = {name: dict(p) for name, p in vars_l["base"].items()}
    for name, stack in run_params["packed"].items():
        if "w" in base[name]:  # a copy for the wgmma decode kernel: decode rows use it
            from pallas_kernels import wgmma_nvfp4

            base[name]["w"] = ByRows(base[name]["w"], LayerOf(stack, index), max_rows=wgmma_nvfp4.MAX_ROWS)
        else:
            base[name]["w"] = LayerOf(stack, index)
    return {**vars_l, "base": base}


def fused_groups(names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The groups of FUSED_GROUPS all of whose projections are in `names`."""
    return tuple(g for g in FUSED_GROUPS if set(g) <= set(names))


def _wgmma_layer(packed: dict[str, Any], layer: jax.Array) -> dict[str, Any]:
    """Each stacked NVFP4 weight's layer `layer` (int32 []) repacked for the wgmma kernel, as a
    `Fused` of its `WgmmaWeight`: the complete groups of FUSED_GROUPS concatenated into
    {fused_name: `Fused`}, each other projection alone {name: `Fused`} (so that its adapter runs
    as a fused call's does, `linear.fused_linear`)."""
    from pallas_kernels import wgmma_nvfp4

    repacked = {name: wgmma_nvfp4.from_packed(jax.tree.map(lambda a: a[layer], w)) for name, w in packed.items()}
    for group in fused_groups(tuple(packed)):
        ws = [repacked.pop(name) for name in group]
        fused = wgmma_nvfp4.concat(ws)
        repacked[fused_name(group)] = Fused(fused, tuple(w.shape[0] for w in ws), max_rows=wgmma_nvfp4.MAX_ROWS)
    return {
        name: w if isinstance(w, Fused) else Fused(w, (w.shape[0],), max_rows=wgmma_nvfp4.MAX_ROWS)
        for name, w in repacked.items()
    }


_wgmma_layer_jit = jax.jit(_wgmma_layer)


def _stacked_loras(layer_loras: list[dict[str, Any]], groups: tuple) -> list[dict[str, Any]]:
    """Per layer, {fused_name(group): the group's adapters stacked} for the ((names), sizes) in
    groups that have any adapter."""
    out = []
    for loras in layer_loras:
        stacked = {fused_name(g): stack_loras([loras.get(n) for n in g], sizes) for g, sizes in groups}
        out.append({name: lora for name, lora in stacked.items() if lora is not None})
    return out


_stacked_loras_jit = jax.jit(_stacked_loras, static_argnums=1)


def _dense_layer(packed: dict[str, Any], layer: jax.Array, backend: str, dtype: str) -> dict[str, jax.Array]:
    """Each stacked packed weight's layer `layer` (int32 []) dequantized, {name: [N, K]}: bf16 by
    the Pallas dequantization kernel (reading the layer's rows in place), or `dtype` (the
    activations') by `dequantize` for "xla"."""
    if backend == "pallas":
        import pallas_kernels  # only needed on this path

        return {name: pallas_kernels.dequantize_bf16(stack, layer=layer) for name, stack in packed.items()}
    return {name: dequantize(jax.tree.map(lambda a: a[layer], stack), dtype) for name, stack in packed.items()}


_dense_layer_jit = jax.jit(_dense_layer, static_argnums=(2, 3))


def _each_layer(program: Callable[..., Any], stacked: dict[str, Any], *static: Any) -> list[Any]:
    """[program(stacked, l, *static) for every layer l]: one compiled program, run once a layer.

    One program over all the layers holds every layer's kernels: for the 1.5B's NVFP4 copies that
    was 196 Pallas dequantization kernels to lower (2.7 s) and 28 layers of wgmma repacking to
    compile (9.5 s), on a 2-core CPU for an H100 (`benchmarks/devtools/compile_census.py`); one
    layer's program takes 0.2 s and 0.6 s. The layer index is traced, so every layer runs the same
    kernels; the per-layer results are the buffers the decode reads.
    """
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    return [program(stacked, np.int32(layer), *static) for layer in range(num_layers)]


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


def packed_names(params: dict[str, Any]) -> tuple[str, ...]:
    """The projections stored packed (4-bit), sorted."""
    return tuple(sorted(_packed_and_copied(params)[0]))


# ----------------------------------------------------------------------------- choices


def _rows_tuple(rows: int | tuple[int, ...]) -> tuple[int, ...]:
    return (rows,) if isinstance(rows, int) else tuple(rows)


def use_dense_weights(
    requested: bool | None,
    *,
    backend: str,
    rows: int | tuple[int, ...],
    dense_bytes: int,
    fits: bool,
) -> bool:
    """`generate`'s choice of bf16 copies of all packed linears (see its dense_weights).

    rows: the decode row bucket(s) of the call; by default copies are made where a bucket's
    per-step path would dequantize anyway (backend "xla", or at least DENSE_FROM_ROWS rows)."""
    if requested is not None:
        return bool(requested) and dense_bytes > 0
    per_step_dequant = backend == "xla" or max(_rows_tuple(rows)) >= DENSE_FROM_ROWS
    return dense_bytes > 0 and per_step_dequant and fits


def dense_weight_names(
    params: dict[str, Any],
    requested: bool | None,
    *,
    backend: str,
    rows: int | tuple[int, ...],
    fits: Callable[[int], bool],
) -> tuple[str, ...]:
    """The packed projections `generate` decodes from bf16 copies (empty: none); `fits(bytes)`
    says whether copies of that size fit the memory budget. See `generate`'s dense_weights."""
    all_bytes = dense_copy_bytes(params)
    if use_dense_weights(
        requested, backend=backend, rows=rows, dense_bytes=all_bytes, fits=fits(all_bytes)
    ):
        return packed_names(params)
    if requested is None and backend == "pallas":
        small = small_packed_names(params)
        if small and fits(dense_copy_bytes(params, small)):
            return small
    return ()


def layer_packed_weights(params: dict[str, Any]) -> int:
    """The number of packed weights in one layer (all its packed projections)."""
    packed, _ = _packed_and_copied(params)
    return sum(2 * w.codes.shape[-2] * w.codes.shape[-1] for w in packed.values())


def small_packed_names(params: dict[str, Any]) -> tuple[str, ...]:
    """The packed projections of at most SMALL_DENSE_WEIGHTS weights per layer."""
    packed, _ = _packed_and_copied(params)
    return tuple(
        sorted(n for n, w in packed.items() if 2 * w.codes.shape[-2] * w.codes.shape[-1] <= SMALL_DENSE_WEIGHTS)
    )


def wgmma_weight_names(
    params: dict[str, Any],
    requested: bool | None,
    *,
    backend: str,
    rows: int | tuple[int, ...],
    exclude: tuple[str, ...] = (),
    fits: Callable[[int], bool] = lambda extra: True,
    kernel_available: bool | None = None,
) -> tuple[str, ...]:
    """The packed projections `generate` repacks for the Hopper wgmma kernel (empty: none).

    rows: the decode row bucket(s) of the call. requested None (auto): on backend "pallas" with
    a bucket of at most WGMMA_MAX_ROWS rows, the kernel available
    (`wgmma_nvfp4.available()`, or `kernel_available`), as many copies as fit `fits(bytes)`;
    True: all of them, wherever the kernel runs, whatever the rows; False: never. Only NVFP4
    projections with N and K multiples of 64, not in `exclude` (small bf16 copies), except that a
    group of FUSED_GROUPS is taken whole when one of it is taken and all of it has the
    layout (one fused call beats a kernel call plus dense dots for the small k/v).

    When not all fit, the largest units (a fused group or a lone projection) are taken first
    while they fit: decode is bandwidth-bound, so the time saved grows with the bytes moved to the
    faster kernel (a 32B policy on an 80 GB GPU keeps its MLP copies when q/k/v/o do not fit).
    """
    if requested is False or backend != "pallas":
        return ()
    from pallas_kernels import wgmma_nvfp4

    if kernel_available is None:
        kernel_available = wgmma_nvfp4.available()
    if not kernel_available or (requested is None and min(_rows_tuple(rows)) > WGMMA_MAX_ROWS):
        return ()
    packed, _ = _packed_and_copied(params)
    fit = {n for n, w in packed.items() if wgmma_nvfp4.layout_fits(w.fmt, w.shape)}
    taken = {n for n in fit if n not in exclude}
    for group in fused_groups(tuple(fit)):
        if taken & set(group):
            taken |= set(group)
    names = tuple(sorted(taken))
    if requested is not None or fits(wgmma_copy_bytes(params, names)):
        return names
    groups = fused_groups(names)
    units = [*groups, *((n,) for n in names if not any(n in g for g in groups))]
    units.sort(key=lambda unit: -wgmma_copy_bytes(params, unit))
    chosen: tuple[str, ...] = ()
    for unit in units:
        if fits(wgmma_copy_bytes(params, chosen + unit)):
            chosen += unit
    return tuple(sorted(chosen))


def decode_weight_names(
    params: dict[str, Any],
    dense_weights: bool | None,
    wgmma_weights: bool | None,
    *,
    backend: str,
    rows: int | tuple[int, ...],
    fits: Callable[[int], bool] = lambda extra: True,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`generate`'s choice of (projections with bf16 copies, projections repacked for the wgmma
    kernel) for decode row bucket(s) `rows`; `fits(bytes)` says whether copies of that size fit.

    The bf16 copies are chosen first (`dense_weight_names`), then the wgmma copies
    (`wgmma_weight_names`). Copies of every packed projection (for the buckets above the
    kernel's rows) and wgmma copies (for those at most WGMMA_MAX_ROWS) coexist: a projection with
    both reads the one for its rows (`split_layers`). Small bf16 copies are dropped for the
    projections the kernel runs (a small projection that completes a fused group goes to it).
    The kernel gets the projections it gets in a call of its rows alone: a call with larger
    buckets too (copies of everything) still leaves it the small ones that such a call keeps on
    their copies (at 1.5B q/k/v/o, decoded faster there, with their adapters' A folded in).
    By default a model below KERNEL_MIN_LAYER_WEIGHTS gets copies of everything and no kernel."""
    every = packed_names(params)
    small_model = layer_packed_weights(params) < KERNEL_MIN_LAYER_WEIGHTS
    if dense_weights is None and wgmma_weights is None and backend == "pallas" and every and small_model:
        if fits(dense_copy_bytes(params, every)):
            return every, ()
    dense = dense_weight_names(
        params, dense_weights, backend=backend, rows=rows, fits=fits
    )
    dense_bytes = dense_copy_bytes(params, dense)
    all_dense = bool(dense) and dense == every
    kernel_rows = tuple(r for r in _rows_tuple(rows) if r <= WGMMA_MAX_ROWS) or rows
    alone = dense_weight_names(params, dense_weights, backend=backend, rows=kernel_rows, fits=fits)
    exclude = () if alone == every else alone
    wgmma = wgmma_weight_names(
        params,
        wgmma_weights,
        backend=backend,
        rows=rows,
        exclude=exclude,
        fits=lambda extra: fits(dense_bytes + extra),
    )
    if all_dense:
        return dense, wgmma
    return tuple(n for n in dense if n not in wgmma), wgmma


# ----------------------------------------------------------------------------- sizes


def device_shape(x: Any) -> tuple[int, ...]:
    """The shape one device holds of an array or `jax.ShapeDtypeStruct`: its shard's under a
    sharding (tensor-parallel weights hold 1/M of a sharded dimension), else the whole shape."""
    try:
        sharding = x.sharding
    except Exception:  # a tracer, or a ShapeDtypeStruct without one
        sharding = None
    return tuple(sharding.shard_shape(x.shape)) if sharding is not None else tuple(x.shape)


def nbytes(x: Any, dtype: Any = None) -> int:
    """Bytes one device holds of an array or a `jax.ShapeDtypeStruct` (shape-only params, e.g. for
    `jax.eval_shape`), or of a copy of it in `dtype`: the copies are made per device, so a
    tensor-parallel weight's copies take 1/M of its bytes on each of the M devices."""
    return math.prod(device_shape(x)) * jnp.dtype(x.dtype if dtype is None else dtype).itemsize


def act_dtype_of(params: dict[str, Any]) -> np.dtype:
    """The activations' dtype: the embedding's (bf16 for a bf16 or 4-bit policy)."""
    return jnp.dtype(params["base"]["embed"].dtype)


def layer_copy_bytes(params: dict[str, Any]) -> int:
    """Bytes of the per-layer copies `split_layers` makes (all but the packed weights; LoRA in
    the activations' dtype, see `_layer_copies`)."""
    _, copied = _packed_and_copied(params)
    lora = copied.pop("lora", {})
    act_dtype = act_dtype_of(params)
    return sum(nbytes(x) for x in jax.tree.leaves(copied)) + sum(nbytes(x, act_dtype) for x in jax.tree.leaves(lora))


def dense_copy_bytes(params: dict[str, Any], names: tuple[str, ...] | None = None) -> int:
    """Bytes of bf16 copies of the packed linears (of `names`, default all: what
    `generate(dense_weights=True)` adds; float32 activations double it on the XLA backend,
    which the estimate ignores)."""
    packed, _ = _packed_and_copied(params)
    # 2 weights per code byte, 2 bytes each
    return sum(4 * math.prod(device_shape(stack.codes)) for n, stack in packed.items() if names is None or n in names)


def wgmma_copy_bytes(params: dict[str, Any], names: tuple[str, ...]) -> int:
    """Bytes of the repacked copies of `names` (as many as the packed codes and scales), plus the
    stacked adapters of their fused groups (`_stacked_loras`, in the activations' dtype)."""
    packed, _ = _packed_and_copied(params)
    total = sum(nbytes(packed[n].codes) + nbytes(packed[n].scales) for n in names)
    return total + _stacked_lora_bytes(params, fused_groups(names))


def fused_lora_bytes(params: dict[str, Any], dense_names: tuple[str, ...], wgmma_names: tuple[str, ...]) -> int:
    """Bytes of the stacked adapters of the dense-fused groups (`dense_fused_groups`) that no
    wgmma copy already stacked (`wgmma_copy_bytes` counts those), and of the adapters' A that
    `split_layers` places below those groups' rows and below each dense ungrouped projection's."""
    counted = set(fused_groups(wgmma_names))
    groups = dense_fused_groups(params, dense_names)
    base_layers = params["base"]["layers"]
    singles = tuple(
        (n,) for n in UNGROUPED
        if n in base_layers and (n in dense_names or not is_packed(base_layers[n]["w"]))
        and _on_one_device(base_layers[n]["w"])
    )  # fmt: skip
    stacked = _stacked_lora_bytes(params, tuple(g for g in groups if g not in counted))
    return stacked + _stacked_lora_bytes(params, groups + singles, with_b=False)


def _stacked_lora_bytes(params: dict[str, Any], groups: tuple[tuple[str, ...], ...], with_b: bool = True) -> int:
    """Bytes of each group's adapters stacked by `linear.stack_loras` (A's concatenated, B's
    block-diagonal; only the A's without `with_b`), in the activations' dtype, over all layers."""
    lora = _packed_and_copied(params)[1].get("lora", {})
    base_layers = params["base"]["layers"]
    act_size = act_dtype_of(params).itemsize
    total = 0
    for group in groups:
        adapters = [lora[n] for n in group if n in lora]
        if adapters:
            layers, rank_sum = adapters[0]["a"].shape[0], sum(a["a"].shape[1] for a in adapters)
            n_sum, k = sum(base_layers[n]["w"].shape[-2] for n in group), base_layers[group[0]]["w"].shape[-1]
            total += layers * rank_sum * (k + (n_sum if with_b else 0)) * act_size
    return total
