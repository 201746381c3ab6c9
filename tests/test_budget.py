"""rollout/budget.py: the rollout's memory estimate against the cache the engine allocates and XLA's
buffer assignment of its programs; `memory.plan_memory` uses the same estimate."""

import jax
import jax.numpy as jnp
import numpy as np
from qwen_shapes import random_params
from rollout_helpers import f32_options, prompts

from qerl_jax.models.qwen2 import ForwardOptions, ModelConfig
from qerl_jax.rollout import (
    SamplingConfig,
    budget,
    cache_bytes,
    estimate_rollout_bytes,
    plan_rollout,
    programs,
    scheduler,
    weights,
)

SMALL = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
)


def _sampling(**kw):
    return SamplingConfig(**{**dict(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=16, eos_ids=()), **kw})


def test_memory_estimate_counts_the_cache(f32_model):
    config, params, _ = f32_model
    shape = (config.num_hidden_layers, 8, 16 + 64, config.num_key_value_heads, config.head_dim)
    assert cache_bytes(config, 8, 80, jnp.float32) == 2 * np.prod(shape) * 4
    small = estimate_rollout_bytes(config, 6, 16, 64, jnp.bfloat16)
    assert small > 2 * cache_bytes(config, 6, 80, jnp.bfloat16)
    assert estimate_rollout_bytes(config, 12, 16, 64) > small
    assert estimate_rollout_bytes(config, 6, 16, 128) > small
    # The engine allocates exactly the estimated cache, and an admission (prefill) keeps it.
    sampling = _sampling()
    static = programs.Static(
        config,
        SamplingConfig(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k),
        programs.ForwardOptions(),
        64,
        "float32",
    )
    ids, mask = prompts(config.vocab_size, pads=(0, 0, 0, 0), width=16)
    rows = jnp.array([0, 0, 1, 1, 2, 2, 3, 3])
    split = weights.split_layers(params)
    cache, state = programs.new_rows(static, 8, 16, 0)
    assert sum(c.nbytes for c in jax.tree.leaves(cache)) == cache_bytes(config, 8, 80, jnp.float32)
    cache, _ = programs.admit(
        static, split, cache, state, ids, mask, rows, jnp.arange(8), jnp.arange(8, dtype=jnp.uint32),
        jnp.full((8,), 64), jax.random.key(0), np.zeros((config.vocab_size,), bool), np.int32(0),
    )  # fmt: skip
    assert sum(c.nbytes for c in jax.tree.leaves(cache)) == cache_bytes(config, 8, 80, jnp.float32)


def test_memory_estimate_covers_the_compiled_programs():
    """XLA's buffer assignment of the admission, decode and compaction programs (CPU): the cache
    and row state are donated and updated in place (aliased: no second cache, the bug behind the
    old out-of-memory at 256 rows x 2304 slots), and each program's temporaries (and the smaller
    bucket a compaction builds) stay within the estimate's term for it."""
    params = random_params(SMALL)
    prompt, new = 16, 448
    plan = plan_rollout(SMALL, params, 32, prompt, new, group_size=4, max_batch=32, options=f32_options())
    assert plan.rows == 32 and plan.smaller == (16,)
    static = programs.Static(SMALL, SamplingConfig(temperature=1.0), ForwardOptions(), new, "float32")
    run_params = weights.split_layers(params)
    cache, rows = programs.new_rows(static, plan.rows, prompt, 0)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(rows))
    cache_b = sum(x.nbytes for x in jax.tree.leaves(cache))
    mem = plan.memory
    assert cache_b == mem.kv_cache == cache_bytes(SMALL, 32, prompt + new, jnp.float32)
    assert state_bytes <= mem.row_state
    k, bp = plan.admit_rows, plan.admit_prompts
    stop = np.zeros((SMALL.vocab_size,), bool)
    admit_args = (
        jnp.ones((bp, prompt), jnp.int32), jnp.ones((bp, prompt), jnp.int32), jnp.zeros((k,), jnp.int32),
        jnp.arange(k, dtype=jnp.int32), jnp.arange(k, dtype=jnp.uint32), jnp.full((k,), new, jnp.int32),
        jax.random.key(0), stop, np.int32(0),
    )  # fmt: skip
    admit = programs.admit.lower(static, run_params, cache, rows, *admit_args).compile().memory_analysis()
    decode = programs.decode.lower(static, run_params, cache, rows, jax.random.key(0), stop, np.int32(0), np.int32(new))
    decode = decode.compile().memory_analysis()
    keep, valid = jnp.zeros((16,), jnp.int32), jnp.ones((16,), bool)
    compact = programs.compact.lower(static, cache, rows, keep, valid).compile().memory_analysis()
    for name, m in (("admit", admit), ("decode", decode)):
        assert m.alias_size_in_bytes >= cache_b + state_bytes, name  # in place
    assert admit.temp_size_in_bytes <= mem.admission
    assert decode.temp_size_in_bytes <= mem.decode
    assert compact.temp_size_in_bytes + compact.output_size_in_bytes <= mem.compaction
    assert decode.temp_size_in_bytes < cache_b / 8  # nothing the size of the cache


def test_memory_plan_uses_the_rollout_estimate():
    """`memory.plan_memory`'s KV cache and rollout activations are the engine's own estimate."""
    from qerl_jax import memory

    inputs = memory.PlanInputs(rollout_batch=64, group_size=8, prompt_len=256, max_new_tokens=2048)
    plan = memory.plan_memory(SMALL, inputs)
    lay = scheduler.layout(64, group_size=8)
    mem = budget.rollout_memory(
        SMALL, 64, 256, 2048, admit_rows=lay.admit_rows, admit_prompts=lay.admit_prompts, compact_rows=16
    )
    assert plan.kv_cache == mem.kv_cache == cache_bytes(SMALL, 64, 2304)
    assert plan.rollout_activations == mem.row_state + mem.work
