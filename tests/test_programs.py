"""rollout/programs.py: the jitted admission, decode and compaction programs compile once per
bucket and serve every later call in it."""

import types

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rollout_helpers import compiled_programs, f32_options, prompts

from qerl_jax.rollout import SamplingConfig, generate, programs

F32 = f32_options()
STOPS = tuple(range(10, 25))  # ~11% of the vocabulary: rows stop at scattered steps, some run to the limit


def _sampling(**kw):
    return SamplingConfig(**{**dict(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=16, eos_ids=()), **kw})


def _batching_sampling(**kw):
    return _sampling(**{"max_new_tokens": 24, "eos_ids": STOPS, **kw})


def _four_prompts(vocab, **kw):
    return prompts(vocab, **{"pads": (0, 3, 5, 1), **kw})


def test_buckets_reuse_compiled_programs(f32_model):
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size, pads=(0, 2, 4, 1), width=11)
    kw = dict(group_size=2, options=F32)
    generate(config, params, ids, mask, jax.random.key(0), _sampling(max_new_tokens=7), **kw)
    before = compiled_programs()
    # Another batch size in the same row buckets (3 prompts / 6 rows vs 4 / 8), other prompt
    # lengths in the same bucket (16), other widths, other max_new_tokens in the same 64
    # bucket, other stop/pad ids: no new program.
    ids2, mask2 = prompts(config.vocab_size, pads=(3, 1, 0), width=14, seed=1)
    generate(config, params, ids2, mask2, jax.random.key(1), _sampling(max_new_tokens=30, eos_ids=(5,)), **kw)
    generate(config, params, ids2[:, 4:], mask2[:, 4:], jax.random.key(1), _sampling(pad_id=3), **kw)
    generate(config, params, ids2, mask2, jax.random.key(1), _sampling(ignore_eos=True), **kw)
    assert compiled_programs() == before
    assert before["prefill"] > 0  # the counter counts at all


def test_compiled_programs_are_few(f32_model):
    """A continuous run compiles one admission program and one decode program per row bucket it
    reaches (plus the gathers between buckets); another call in the same buckets compiles nothing."""
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size, width=20)  # prompt bucket 32: programs not compiled yet
    kw = dict(group_size=3, options=f32_options(smaller_rows=(8, 4)))
    before = compiled_programs()
    generate(config, params, ids, mask, jax.random.key(1), _batching_sampling(), **kw)
    first = {k: compiled_programs()[k] - before[k] for k in before}
    assert first["prefill"] == 1 and 1 <= first["decode"] <= 3 and first["compact"] <= 2, first
    # Other batch sizes in the same bucket, other max_new_tokens / stop ids / limits: nothing new.
    generate(config, params, ids[:3], mask[:3], jax.random.key(2), _batching_sampling(max_new_tokens=40), **kw)
    limits = np.full((12,), 30, np.int32)
    generate(
        config,
        params,
        ids,
        mask,
        jax.random.key(3),
        _batching_sampling(max_new_tokens=60),
        max_new_tokens_per_seq=limits,
        **kw,
    )
    generate(config, params, ids, mask, jax.random.key(4), _batching_sampling(ignore_eos=True, max_new_tokens=9), **kw)
    total = {k: compiled_programs()[k] - before[k] for k in before}
    assert total["prefill"] == 1 and total["decode"] <= 3 and total["compact"] <= 2, total


def test_a_tensor_parallel_shard_splits_the_cache_heads_over_its_model_devices():
    """Rows replicated over a shard's M model devices: the cache's kv heads split over "model"
    (where the k/v projections leave them, so the programs return the cache as they took it and
    none compiles again in the decode loop); rows split over "data", one device, M not dividing
    the heads: the rows' sharding."""
    static = types.SimpleNamespace(config=types.SimpleNamespace(num_key_value_heads=4))
    tp = AbstractMesh((1, 2), ("data", "model"))
    assert programs.cache_sharding(static, NamedSharding(tp, P())).spec == P(None, None, "model")
    for mesh, spec in (
        (AbstractMesh((1, 3), ("data", "model")), P()),
        (AbstractMesh((2, 1), ("data", "model")), P("data")),
    ):
        rows = NamedSharding(mesh, spec)
        assert programs.cache_sharding(static, rows) == rows
    assert programs.cache_sharding(static, None) is None
