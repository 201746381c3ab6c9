"""What the benchmarks share: the timing of a rollout's phases (`timed_generate`).

The rollout engine keeps no timing hooks: a rollout's prefill is timed as the same call with
every sequence limited to one token (the same programs: token limits are runtime arguments, so
nothing new is compiled), and its decode as the rest of the full call's wall time.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from qerl_jax.rollout import (
    RolloutOptions,
    SamplingConfig,
    generate,
    new_tokens_bucket,
    plan_rollout,
    prompt_bucket,
    weights,
)


def timed_generate(
    config,
    params: dict[str, Any],
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    key: jax.Array,
    sampling: SamplingConfig,
    *,
    group_size: int = 1,
    lora_scale: float = 1.0,
    max_batch: int | None = None,
    max_new_tokens_per_seq: np.ndarray | int | None = None,
    options: RolloutOptions = RolloutOptions(),
):
    """`generate` twice (one token per sequence, then the full call) -> (batch, timings).

    max_new_tokens_per_seq: as `generate`'s, or an int for every sequence (e.g. a few steps timed
    at the cache size of sampling.max_new_tokens). Timings: "prefill_s" (the one-token call:
    weight copies, admissions, first tokens), "decode_s" (the full call's wall time less that),
    "wall_s", "steps" (1 + the decode steps of every segment), "decode_steps", "rows" (the first
    row bucket), "estimated_bytes" (the engine's memory estimate) and "wgmma_copy_bytes".
    """
    total = np.asarray(prompt_ids).shape[0] * group_size
    limits = max_new_tokens_per_seq
    if isinstance(limits, int):
        limits = np.full((total,), limits, np.int32)
    kw = dict(group_size=group_size, lora_scale=lora_scale, max_batch=max_batch, options=options)
    t = time.perf_counter()
    one = generate(config, params, prompt_ids, prompt_mask, key, sampling, max_new_tokens_per_seq=np.ones((total,), np.int32), **kw)  # fmt: skip
    jax.block_until_ready(one.tokens)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    batch = generate(config, params, prompt_ids, prompt_mask, key, sampling, max_new_tokens_per_seq=limits, **kw)
    jax.block_until_ready(batch.tokens)
    wall_s = time.perf_counter() - t
    plan = plan_rollout(
        config,
        params,
        total,
        prompt_bucket(int(np.asarray(prompt_mask).sum(axis=1).max())),
        new_tokens_bucket(sampling.max_new_tokens),
        group_size=group_size,
        max_batch=max_batch,
        options=options,
    )
    segments = np.asarray(batch.steps)
    return batch, {
        "prefill_s": prefill_s,
        "decode_s": max(wall_s - prefill_s, 0.0),
        "wall_s": wall_s,
        "steps": int(segments.sum()),
        "decode_steps": int(segments.sum() - len(segments)),
        "rows": plan.rows,
        "estimated_bytes": plan.memory.total,
        "wgmma_copy_bytes": weights.wgmma_copy_bytes(params, plan.wgmma_names),
    }
