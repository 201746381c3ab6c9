"""Multi-GPU through `jax.sharding`: a ("data", "model") mesh and partition rules per parameter.

No communication is written by hand: parameters and batches are placed with `NamedSharding`s
and `jax.jit` propagates the shardings through the model (XLA inserts the collectives).

Strategies for the frozen base (stacked weights W [L, N, K], the HF layout):

- "tp" (tensor parallel over "model"): q/k/v/gate/up are column-parallel (N sharded), o/down
  row-parallel (K sharded), embed/lm_head sharded along the vocabulary. A `PackedWeight`
  shards its codes [L, N, K/2], scales [L, N, K/block] the same way (global_scale [L] is
  replicated); K-sharding a packed weight needs whole blocks per shard, i.e. (K / block)
  divisible by the axis size.
- "fsdp" (fully sharded over "data"): every base weight N-sharded (codes and scales alike),
  embed/lm_head along the vocabulary; XLA all-gathers a layer's weights where they are used.

A dimension that does not divide by the axis size is replicated instead, and the reason is
logged. Norms are replicated. LoRA adapters follow their base weight under "tp" (B [L, N, r]
N-sharded for a column-parallel base, A [L, r, K] K-sharded for a row-parallel one, so the
adapter delta is computed where the base output shard lives) and are replicated under "fsdp"
(they are small). Batches shard their leading axis over "data" (`shard_batch`; rollouts:
`qerl_jax.rollout.generate(..., options=RolloutOptions(batch_sharding=data_sharding(mesh)))`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qerl_jax.models.qwen2 import PROJECTIONS
from qerl_jax.projections import COLUMN_PARALLEL, ROW_PARALLEL
from qerl_jax.quant.packed import PackedWeight, split_specs, splits_over

log = logging.getLogger(__name__)

AXES = ("data", "model")
STRATEGIES = ("tp", "fsdp")


def make_mesh(data: int = -1, model: int = 1, devices: list | None = None) -> Mesh:
    """A 2-D device mesh with axes ("data", "model") of sizes (data, model).

    One of the sizes may be -1: all remaining devices. The product must equal the number of
    devices (all of `jax.devices()` unless `devices` is given).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {"mesh.data": data, "mesh.model": model}
    for name, size in sizes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"{name} must be a positive int or -1 (all remaining devices); got {size!r}")
    if data == -1 and model == -1:
        raise ValueError("only one of mesh.data and mesh.model may be -1")
    if data == -1 or model == -1:
        known = model if data == -1 else data
        if n % known:
            raise ValueError(f"{n} devices do not split into mesh axes of size {known} and -1")
        data, model = (n // known, model) if data == -1 else (data, n // known)
    if data * model != n:
        raise ValueError(f"mesh.data={data} x mesh.model={model} = {data * model} devices, but {n} are available")
    return Mesh(np.asarray(devices, dtype=object).reshape(data, model), AXES)


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path_names(path) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in path)


def _maybe(spec: tuple, shape: tuple[int, ...], axis_sizes: dict[str, int], what: str) -> P:
    """P(*spec), with every axis whose dimension does not divide replicated (logged)."""
    out = []
    for dim, axis in zip(shape, spec):
        if axis is not None and dim % axis_sizes[axis]:
            log.info(
                "replicating %s: dimension %d does not divide by mesh axis %r of size %d",
                what,
                dim,
                axis,
                axis_sizes[axis],
            )
            axis = None
        out.append(axis)
    return P(*out)


def _packed_specs(w: PackedWeight, dim: int, axis: str, axis_sizes: dict[str, int], what: str) -> PackedWeight:
    """Specs for a PackedWeight sharded along logical dim -2 (N) or -1 (K, whole blocks) over `axis`."""
    *_, n, k = w.shape
    if splits_over(n, k, dim, axis_sizes[axis], w.block_size):
        return split_specs(w, dim, axis)
    log.info(
        "replicating %s: [N, K] = [%d, %d] (K in %d blocks of %d) does not split along dim %d over mesh axis %r of size %d",
        what, n, k, k // w.block_size, w.block_size, dim, axis, axis_sizes[axis],
    )  # fmt: skip
    return split_specs(w, None, axis)


def _weight_spec(w, proj: str, strategy: str, axis_sizes: dict[str, int], what: str):
    """Spec(s) of a stacked base weight [L, N, K] (dense array or PackedWeight)."""
    if strategy == "fsdp":
        dim, axis = -2, "data"
    else:
        dim, axis = (-2 if proj in COLUMN_PARALLEL else -1), "model"
    if isinstance(w, PackedWeight):
        return _packed_specs(w, dim, axis, axis_sizes, what)
    spec = [None] * np.ndim(w)
    spec[dim] = axis
    return _maybe(tuple(spec), np.shape(w), axis_sizes, what)


def _lora_spec(leaf, names: tuple[str, ...], strategy: str, axis_sizes: dict[str, int]) -> P:
    """A [L, r, K] / B [L, N, r]: matched to the base weight under "tp", replicated otherwise."""
    shape = np.shape(leaf)
    replicated = P(*((None,) * len(shape)))
    proj = next((n for n in reversed(names) if n in PROJECTIONS), None)
    if strategy != "tp" or proj is None or not names or names[-1] not in ("a", "b") or len(shape) < 2:
        return replicated
    spec = [None] * len(shape)
    if proj in COLUMN_PARALLEL and names[-1] == "b":
        spec[-2] = "model"  # B [.., N, r]
    elif proj in ROW_PARALLEL and names[-1] == "a":
        spec[-1] = "model"  # A [.., r, K]
    else:
        return replicated
    return _maybe(tuple(spec), shape, axis_sizes, "lora/" + "/".join(names))


def _check(mesh: Mesh, strategy: str) -> dict[str, int]:
    if strategy not in STRATEGIES:
        raise ValueError(f"sharding strategy {strategy!r} is not supported; expected one of {STRATEGIES}")
    missing = set(AXES) - set(mesh.axis_names)
    if missing:
        raise ValueError(f"mesh axes {mesh.axis_names} lack {sorted(missing)}; build it with make_mesh")
    return dict(mesh.shape)


def _base_specs(base: dict[str, Any], strategy: str, axis_sizes: dict[str, int]) -> dict[str, Any]:
    vocab_axis = "data" if strategy == "fsdp" else "model"
    out: dict[str, Any] = {}
    for name, value in base.items():
        if name in ("embed", "lm_head"):
            out[name] = _maybe((vocab_axis, None), np.shape(value), axis_sizes, f"base/{name}")
        elif name == "layers":
            layers = {}
            for proj, leaves in value.items():
                layers[proj] = {}
                for leaf_name, leaf in leaves.items():
                    what = f"base/layers/{proj}/{leaf_name}"
                    if leaf_name == "w":
                        layers[proj][leaf_name] = _weight_spec(leaf, proj, strategy, axis_sizes, what)
                    elif leaf_name == "b" and strategy == "tp" and proj in COLUMN_PARALLEL:
                        layers[proj][leaf_name] = _maybe((None, "model"), np.shape(leaf), axis_sizes, what)
                    elif leaf_name == "b" and strategy == "fsdp":
                        layers[proj][leaf_name] = _maybe((None, "data"), np.shape(leaf), axis_sizes, what)
                    else:
                        layers[proj][leaf_name] = jax.tree.map(lambda x: P(*((None,) * np.ndim(x))), leaf)
            out[name] = layers
        else:
            out[name] = jax.tree.map(lambda x: P(*((None,) * np.ndim(x))), value)
    return out


def lora_specs(tree: Any, mesh: Mesh, strategy: str = "tp") -> Any:
    """PartitionSpecs for a LoRA pytree, or any pytree that mirrors it (gradients, AdamW state).

    Leaves are recognised by their path ending in <proj>/a or <proj>/b; everything else
    (e.g. optax's step count) is replicated.
    """
    axis_sizes = _check(mesh, strategy)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _lora_spec(leaf, _path_names(path), strategy, axis_sizes), tree
    )


def param_specs(params: dict[str, Any], mesh: Mesh, strategy: str = "tp") -> dict[str, Any]:
    """PartitionSpecs for {"base", "norms", "lora"}: the same tree structure as `params`."""
    axis_sizes = _check(mesh, strategy)
    unknown = set(params) - {"base", "norms", "lora"}
    if unknown:
        raise ValueError(f"params has unexpected top-level keys {sorted(unknown)}; expected base, norms, lora")
    out: dict[str, Any] = {}
    if "base" in params:
        out["base"] = _base_specs(params["base"], strategy, axis_sizes)
    if "norms" in params:
        out["norms"] = jax.tree.map(lambda x: P(*((None,) * np.ndim(x))), params["norms"])
    if "lora" in params:
        out["lora"] = lora_specs(params["lora"], mesh, strategy)
    return out


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_shardings(params: dict[str, Any], mesh: Mesh, strategy: str = "tp") -> dict[str, Any]:
    """`NamedSharding`s for every parameter (see the module docstring for the rules)."""
    return _named(mesh, param_specs(params, mesh, strategy))


def shard_params(params: dict[str, Any], mesh: Mesh, strategy: str = "tp") -> dict[str, Any]:
    """Places `params` on the mesh with `param_shardings`."""
    return jax.device_put(params, param_shardings(params, mesh, strategy))


def shard_like_lora(tree: Any, mesh: Mesh, strategy: str = "tp") -> Any:
    """Places a LoRA-shaped pytree (LoRA params, gradients, optimizer state) on the mesh."""
    return jax.device_put(tree, _named(mesh, lora_specs(tree, mesh, strategy)))


def data_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Batch arrays: leading (batch) axis over "data", the rest replicated."""
    return NamedSharding(mesh, P("data", *((None,) * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_batch(tree: Any, mesh: Mesh, batch_size: int | None = None) -> Any:
    """Places a batch of host arrays on the mesh: every array whose leading axis divides by the
    "data" axis is split along it (a packed train batch's rows [R, L] and its sequences [B, L]
    alike, so each device computes its share of every micro-batch); the others are replicated.

    Every process passes the same host values and gets the global arrays (each device's slice
    is taken from them: `jax.make_array_from_callback`), so this serves multi-process runs too.
    batch_size: a leading length that must divide (default: the first array leaf's); an
    indivisible one is an error.
    """
    leaves = [x for x in jax.tree.leaves(tree) if np.ndim(x) > 0]
    data = mesh.shape["data"]
    if batch_size is None and leaves:
        batch_size = np.shape(leaves[0])[0]
    if batch_size is not None and batch_size % data:
        raise ValueError(f"batch size {batch_size} does not divide by the mesh's data axis ({data} devices)")

    def place(x):
        x = np.asarray(x)
        split = x.ndim > 0 and x.shape[0] % data == 0
        where = data_sharding(mesh, x.ndim) if split else replicated(mesh)
        return jax.make_array_from_callback(x.shape, where, lambda index: x[index])

    return jax.tree.map(place, tree)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def maybe_initialize_distributed() -> bool:
    """Calls `jax.distributed.initialize()` for a multi-process run; returns whether it did.

    Multi-process when QERL_NUM_PROCESSES (or JAX_NUM_PROCESSES) > 1: then QERL_PROCESS_ID
    (or JAX_PROCESS_ID) and JAX_COORDINATOR_ADDRESS (host:port of process 0) must be set too
    and are passed explicitly. Also when only JAX_COORDINATOR_ADDRESS is set, or under SLURM
    with more than one task (SLURM_NTASKS > 1): JAX's cluster detection finds the rest.
    Otherwise it does nothing (one process drives all its local GPUs anyway).
    """
    # CPU devices of several processes talk through gloo (GPUs through NCCL, unaffected by this).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    num = _env_int("QERL_NUM_PROCESSES")
    num = _env_int("JAX_NUM_PROCESSES") if num is None else num
    pid = _env_int("QERL_PROCESS_ID")
    pid = _env_int("JAX_PROCESS_ID") if pid is None else pid
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num is not None and num > 1:
        if pid is None or coordinator is None:
            raise ValueError(
                f"QERL_NUM_PROCESSES={num} also needs QERL_PROCESS_ID (0..{num - 1}) and "
                "JAX_COORDINATOR_ADDRESS (host:port of process 0)"
            )
        if not 0 <= pid < num:
            raise ValueError(f"QERL_PROCESS_ID={pid} must be in [0, {num})")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid)
        return True
    if num is not None:  # explicitly one process
        return False
    if coordinator is not None:
        jax.distributed.initialize(coordinator_address=coordinator, process_id=pid)
        return True
    ntasks = _env_int("SLURM_NTASKS")
    if ntasks is not None and ntasks > 1 and os.environ.get("SLURM_JOB_ID"):
        jax.distributed.initialize()
        return True
    return False
