"""Data-parallel rollouts: every data shard of a mesh decodes its own block of prompts.

    batch = generate_data_parallel(config, params, prompt_ids, prompt_mask, key, sampling,
                                   mesh=mesh, group_size=8)

The B prompts are cut into `mesh.shape["data"]` contiguous blocks (`prompt_blocks`; or any
split the caller gives, `ShardPlan.prompts`), so a prompt's group never spans two shards and its
advantages need no communication. A shard is one
row of the mesh: its `model` devices (tensor parallel within the shard, or one device). Each
shard this process holds (`local_shards`) runs `generate` on its own devices in its own thread,
with its own continuous-batching scheduler and programs, over a zero-copy view of the
parameters on its devices (`on_submesh`): nothing crosses shards while decoding. The blocks'
results are gathered once on every process (`gather_blocks`) and put back in prompt order.

Each shard samples its rows with their streams in the whole batch (`RolloutPart.streams`), so
the tokens equal those of one `generate` call over the whole batch with the same key (up to
the float error of other row buckets).

With partial rollouts (`ShardPlan.parts` with partials), each shard's call resumes its own sequences under way and
ends when its own monitor is done, pausing its rows; the call returns once every shard has
ended, with the paused sequences of all shards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qerl_jax.rollout.batch import PER_ROW, PER_SEGMENT, RolloutBatch, concat, select_rows
from qerl_jax.rollout.sampler import Partial, RolloutOptions, RolloutPart, generate


def prompt_blocks(num_prompts: int, shards: int) -> list[slice]:
    """Contiguous blocks of prompts, one per shard, sizes differing by at most one (earlier larger)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1; got {shards}")
    bounds = np.cumsum([0] + [len(b) for b in np.array_split(np.arange(num_prompts), shards)])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def shard_count(mesh: Mesh | None) -> int:
    """The data shards of a run's mesh (one without a mesh)."""
    return mesh.shape["data"] if mesh is not None else 1


def local_shards(mesh: Mesh) -> list[tuple[int, Mesh]]:
    """(data index, a 1 x model sub-mesh) of each mesh row whose devices are all this process's."""
    mine = set(jax.local_devices())
    out = []
    for d, row in enumerate(mesh.devices):
        if all(dev in mine for dev in row):
            out.append((d, Mesh(np.asarray(row).reshape(1, -1), mesh.axis_names)))
        elif any(dev in mine for dev in row):
            raise ValueError(
                f"mesh row {d} mixes this process's devices with others': a data shard's model devices must be one "
                "process's (mesh.model must divide the devices per process)"
            )
    return out


def on_submesh(tree: Any, sub: Mesh) -> Any:
    """`tree`'s arrays on `sub`'s devices, without copying: each leaf must be replicated over the
    mesh's "data" axis (the base, norms and LoRA are: tensor parallel over "model" at most)."""
    devices = list(sub.devices.flat)

    def view(x):
        if not isinstance(x, jax.Array):
            return x
        named = isinstance(x.sharding, NamedSharding)
        if not named and not x.sharding.is_fully_replicated:
            raise ValueError(f"on_submesh needs NamedSharding or replicated arrays; got {x.sharding}")
        spec = x.sharding.spec if named else P()
        if "data" in jax.tree.leaves(tuple(spec)):
            raise ValueError(f"on_submesh needs arrays replicated over 'data'; got one sharded as {spec}")
        by_device = {s.device: s.data for s in x.addressable_shards}
        if not all(d in by_device for d in devices):  # e.g. a small array on one device: copied
            return jax.device_put(x, NamedSharding(sub, spec))
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(sub, spec), [by_device[d] for d in devices]
        )

    return jax.tree.map(view, tree)


def share_rows(values_xN: np.ndarray, mine_N: np.ndarray) -> np.ndarray:
    """Per-row values [..., N] that each process computed for its own rows (mine_N), complete on
    every process."""
    if jax.process_count() == 1:
        return values_xN
    return _merge_over_processes(np.where(mine_N, values_xN, 0).astype(values_xN.dtype))


def _merge_over_processes(own: np.ndarray) -> np.ndarray:
    """Every process's `own` (zeros where another process holds the values) merged: their sum
    (any, for bool)."""
    everyone = multihost_utils.process_allgather(own)
    return everyone.any(axis=0) if own.dtype == bool else everyone.sum(axis=0, dtype=own.dtype)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)]) if x.shape[0] < rows else x


def gather_blocks(blocks: dict[int, dict[str, np.ndarray]], num_shards: int) -> list[dict[str, np.ndarray]]:
    """Every shard's arrays on every process, in shard order: `blocks` holds this process's shards
    ({data index: {name: array}}, arrays of a name alike but for their leading axis); in a
    multi-process run they are exchanged once (`multihost_utils.process_allgather`)."""
    if jax.process_count() == 1:
        return [blocks[d] for d in range(num_shards)]
    some = next(iter(blocks.values()))
    names = sorted(some)
    counts = np.zeros((num_shards, len(names)), np.int64)
    for d, arrays in blocks.items():
        counts[d] = [arrays[n].shape[0] for n in names]
    counts = _merge_over_processes(counts)  # each process fills its own shards' rows
    gathered = {}
    for i, name in enumerate(names):
        rows = int(counts[:, i].max())
        local = np.zeros((num_shards, rows, *some[name].shape[1:]), some[name].dtype)
        for d, arrays in blocks.items():
            local[d] = _pad_rows(arrays[name], rows)
        gathered[name] = _merge_over_processes(local)
    return [{n: gathered[n][d, : counts[d, i]] for i, n in enumerate(names)} for d in range(num_shards)]


def _host(batch: RolloutBatch) -> dict[str, np.ndarray]:
    return {f: np.asarray(getattr(batch, f)) for f in (*PER_ROW, *PER_SEGMENT)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """How a `generate_data_parallel` call's rows are dealt and watched, shard by shard.

    prompts: each data shard's prompts (indices, in the order it samples them); default: contiguous
      blocks (`prompt_blocks`).
    streams: int [B * G] each output row's PRNG stream in the whole batch (default its row index).
    max_new_tokens_per_seq: int [B * G] each row's token limit, as `generate`'s (default none).
    parts: {data index: `RolloutPart`} for this process's shards: the shard's monitor (over its call's
      rows), expected_seqs and partial (seqs_K its call's rows, its prompts' samples in its order);
      their `streams` are ignored (taken from `streams`). With partials (partial rollouts), each shard
      ends when its own monitor is `done` and pauses its own rows, whatever the others do.
    """

    prompts: list[np.ndarray] | None = None
    streams: np.ndarray | None = None
    max_new_tokens_per_seq: np.ndarray | None = None
    parts: dict[int, RolloutPart] = dataclasses.field(default_factory=dict)

    def resumable(self) -> bool:
        """Whether the shards' calls carry partial rollouts (then they return paused sequences too)."""
        return any(part.partial is not None for part in self.parts.values())


def generate_data_parallel(
    config,
    params: dict[str, Any],
    prompt_ids,
    prompt_mask,
    key: jax.Array,
    sampling,
    *,
    mesh: Mesh,
    group_size: int = 1,
    lora_scale: float = 1.0,
    max_batch: int | None = None,
    plan: ShardPlan = ShardPlan(),
    options: RolloutOptions = RolloutOptions(),
) -> RolloutBatch | tuple[RolloutBatch, Partial]:
    """`generate` over the mesh's data shards (module doc); the same arguments, and the same
    RolloutBatch on every process. max_batch and the memory budget are per shard; plan: which rows
    each shard samples, on which streams, under which monitor (`ShardPlan`). With partial rollouts
    (the plan's parts carry partials) the call returns (the batch, every shard's paused sequences as
    one `Partial` of batch rows), as `generate` does.
    """
    ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    shards = mesh.shape["data"]
    _check_prompt_count(ids, shards)
    shard_prompts = plan.prompts
    if shard_prompts is None:
        shard_prompts = [np.arange(b.start, b.stop) for b in prompt_blocks(ids.shape[0], shards)]
    rows_of = [(p[:, None] * group_size + np.arange(group_size)).reshape(-1) for p in shard_prompts]
    limits = None if plan.max_new_tokens_per_seq is None else np.asarray(plan.max_new_tokens_per_seq)
    streams = np.arange(ids.shape[0] * group_size) if plan.streams is None else np.asarray(plan.streams)
    resumable = plan.resumable()
    key = np.asarray(jax.random.key_data(key)), jax.random.key_impl(key)

    def run(d: int, sub: Mesh) -> dict[str, np.ndarray]:
        prompts, rows = shard_prompts[d], rows_of[d]
        shard_options = options
        if sub.devices.size > 1:  # rows replicated over the shard's tensor-parallel devices
            shard_options = dataclasses.replace(options, batch_sharding=NamedSharding(sub, P()))
        part = dataclasses.replace(plan.parts.get(d, RolloutPart()), streams=streams[rows])
        with jax.default_device(sub.devices.flat[0]):
            shard_key = jax.device_put(jax.random.wrap_key_data(key[0], impl=key[1]), NamedSharding(sub, P()))
            batch = generate(
                config, on_submesh(params, sub), ids[prompts], mask[prompts], shard_key, sampling,
                group_size=group_size, lora_scale=lora_scale, max_batch=max_batch,
                max_new_tokens_per_seq=None if limits is None else limits[rows], part=part, options=shard_options,
            )  # fmt: skip
            batch, paused = batch if resumable else (batch, None)
            out = _host(batch)
            out["prompt_index"] = prompts[out["prompt_index"]].astype(np.int32)
            return out if paused is None else {**out, **_paused_arrays(paused, rows)}

    local = local_shards(mesh)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(local), thread_name_prefix="rollout-shard") as pool:
        futures = {d: pool.submit(run, d, sub) for d, sub in local}
        done = {d: f.result() for d, f in futures.items()}
    parts = gather_blocks(done, shards)
    batch = in_prompt_order(parts, group_size)
    return (batch, _paused_of(parts)) if resumable else batch


# The paused sequences' arrays among a shard's host arrays (`generate_data_parallel` with partials).
PAUSED = "paused."


def _paused_arrays(paused: Partial, rows: np.ndarray) -> dict[str, np.ndarray]:
    """A shard's paused sequences as host arrays, their rows (`rows`: the shard call's rows in the whole
    batch) the whole batch's."""
    paused = dataclasses.replace(paused, seqs_K=rows[paused.seqs_K].astype(np.int64))
    return {PAUSED + f.name: getattr(paused, f.name) for f in dataclasses.fields(Partial)}


def _paused_of(parts: list[dict[str, np.ndarray]]) -> Partial:
    """Every shard's paused sequences (`_paused_arrays`), gathered, as one `Partial`."""
    return Partial(**{f.name: np.concatenate([p[PAUSED + f.name] for p in parts]) for f in dataclasses.fields(Partial)})


def _check_prompt_count(ids: np.ndarray, shards: int) -> None:
    if ids.ndim != 2 or ids.shape[0] < shards:
        raise ValueError(
            f"a data-parallel rollout needs at least one prompt per data shard: {ids.shape[0] if ids.ndim else 0} "
            f"prompts for {shards} shards"
        )


def in_prompt_order(parts: list[dict[str, np.ndarray]], group_size: int) -> RolloutBatch:
    """One RolloutBatch of the shards' rows (`prompt_index` global), sorted back into prompt-major
    order (a stable sort: sample g of a prompt stays its row g)."""
    # Joined and sorted on the host, put on the device once (`concat`).
    fields = (*PER_ROW, *PER_SEGMENT)
    joined = concat([RolloutBatch(**{f: p[f] for f in fields}, group_size=group_size) for p in parts])
    return jax.device_put(select_rows(joined, np.argsort(joined.prompt_index, kind="stable")))
