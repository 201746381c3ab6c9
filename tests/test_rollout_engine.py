"""The rollout engine's scheduling and memory: continuous batching (refill, compaction) against one
batch of every sequence, per-sequence token limits, compile counts, the memory estimate against XLA's
buffer assignment, and the errors raised before anything is compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qerl_jax
from qerl_jax.models.qwen2 import ForwardOptions, ModelConfig, projection_shapes
from qerl_jax.rollout import (
    RolloutOptions,
    SamplingConfig,
    budget,
    cache_bytes,
    generate,
    plan_rollout,
    programs,
    scheduler,
    weights,
)


@pytest.fixture(scope="module")
def f32_model(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    return qerl_jax.load_model(path, dtype="float32")


def _options(**kw) -> RolloutOptions:
    return RolloutOptions(cache_dtype=jnp.float32, **kw)


def _compiled() -> dict[str, int]:
    """How many programs of each kind jit holds compiled."""
    return {"prefill": programs.admit._cache_size(), "decode": programs.decode._cache_size(),
            "compact": programs.compact._cache_size()}  # fmt: skip


STOPS = tuple(range(10, 25))  # ~11% of the vocabulary: rows stop at scattered steps, some run to the limit


def _prompts(vocab, pads=(0, 3, 5, 1), width=9, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(len(pads), width)).astype(np.int32)
    mask = np.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def _sampling(**kw):
    return SamplingConfig(**{**dict(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=24, eos_ids=STOPS), **kw})


def _assert_same(a, b, name):
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens), err_msg=name)
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths), err_msg=name)
    np.testing.assert_array_equal(np.asarray(a.truncated), np.asarray(b.truncated), err_msg=name)


# ----------------------------------------------------------------------------- continuous = fixed


def test_continuous_batching_samples_what_one_batch_samples(f32_model):
    """4 prompts x 3 samples: every row count draws the same tokens, log-probs and lengths per
    sequence, with max_batch below (groups split across refills), equal to and above B * G, rows
    stopping mid-run (EOS) and at the limit, and the tail compacted into smaller buckets."""
    config, params = f32_model
    ids, mask = _prompts(config.vocab_size)
    key = jax.random.key(7)
    fixed = generate(config, params, ids, mask, key, _sampling(), group_size=3, options=_options(smaller_rows=()))
    assert fixed.steps.shape == (1,)  # every sequence in one batch, no refill, no compaction
    lengths = np.asarray(fixed.lengths)
    assert lengths.min() < 24 and len(set(lengths.tolist())) > 3  # EOS in the middle, at many steps
    assert np.asarray(fixed.truncated).any() and not np.asarray(fixed.truncated).all()
    variants = {
        "all rows, compacted": (None, (8, 4, 2)),
        "max_batch = N": (12, ()),
        "max_batch > N": (50, None),
        "max_batch 5: groups of 3 split over refills": (5, (4, 2)),
        "max_batch 2": (2, None),
    }
    for name, (max_batch, smaller) in variants.items():
        opts = _options(smaller_rows=smaller)
        other = generate(config, params, ids, mask, key, _sampling(), group_size=3, max_batch=max_batch, options=opts)
        _assert_same(other, fixed, name)
        if name.startswith("max_batch 5"):  # 12 sequences through 5 rows: refilled as they stop
            assert other.steps.shape[0] > 3
            assert plan_rollout(config, params, 12, 16, 64, group_size=3, max_batch=5, options=opts).rows == 8
        if name == "all rows, compacted":
            assert other.steps.shape[0] > 1  # compacted: the tail ran in smaller buckets
            assert plan_rollout(config, params, 12, 16, 64, group_size=3, options=opts).rows == 16


def test_per_sequence_token_limits(f32_model):
    """max_new_tokens_per_seq stops each sequence at its own limit, marked truncated; its tokens
    are the prefix of the same sequence without the limit (its own PRNG stream)."""
    config, params = f32_model
    ids, mask = _prompts(config.vocab_size)
    kw = dict(group_size=3, max_batch=5, options=_options(smaller_rows=(4, 2)))
    key = jax.random.key(8)
    free = generate(config, params, ids, mask, key, _sampling(eos_ids=()), **kw)
    limits = np.array([1, 2, 3, 24, 5, 8, 13, 21, 7, 1, 16, 4], np.int32)
    capped = generate(config, params, ids, mask, key, _sampling(eos_ids=()), max_new_tokens_per_seq=limits, **kw)
    assert np.asarray(capped.lengths).tolist() == limits.tolist()
    assert np.asarray(capped.truncated).all()
    tokens, free_tokens = np.asarray(capped.tokens), np.asarray(free.tokens)
    for row, limit in enumerate(limits):
        np.testing.assert_array_equal(tokens[row, :limit], free_tokens[row, :limit])
        assert (tokens[row, limit:] == 0).all()
        assert (np.asarray(capped.response_mask)[row] == (np.arange(24) < limit)).all()
    # With stop ids, a sequence ends at the earlier of its stop and its limit.
    stopped = generate(config, params, ids, mask, key, _sampling(), **kw)
    both = generate(config, params, ids, mask, key, _sampling(), max_new_tokens_per_seq=limits, **kw)
    expected = np.minimum(np.asarray(stopped.lengths), limits)
    assert np.asarray(both.lengths).tolist() == expected.tolist()
    hit_stop = np.asarray(stopped.lengths) <= limits
    np.testing.assert_array_equal(np.asarray(both.truncated), ~(hit_stop & ~np.asarray(stopped.truncated)))


def test_unshared_prefill_samples_the_same(f32_model):
    config, params = f32_model
    ids, mask = _prompts(config.vocab_size)
    kw = dict(group_size=3, max_batch=5)
    key = jax.random.key(9)
    ref = generate(config, params, ids, mask, key, _sampling(), **kw, options=_options(smaller_rows=(4,)))
    unshared = _options(smaller_rows=(4,), share_prefill=False)
    _assert_same(generate(config, params, ids, mask, key, _sampling(), **kw, options=unshared), ref, "unshared")


def test_compiled_programs_are_few(f32_model):
    """A continuous run compiles one admission program and one decode program per row bucket it
    reaches (plus the gathers between buckets); another call in the same buckets compiles nothing."""
    config, params = f32_model
    ids, mask = _prompts(config.vocab_size, width=20)  # prompt bucket 32: programs not compiled yet
    kw = dict(group_size=3, options=_options(smaller_rows=(8, 4)))
    before = _compiled()
    generate(config, params, ids, mask, jax.random.key(1), _sampling(), **kw)
    first = {k: _compiled()[k] - before[k] for k in before}
    assert first["prefill"] == 1 and 1 <= first["decode"] <= 3 and first["compact"] <= 2, first
    # Other batch sizes in the same bucket, other max_new_tokens / stop ids / limits: nothing new.
    generate(config, params, ids[:3], mask[:3], jax.random.key(2), _sampling(max_new_tokens=40), **kw)
    limits = np.full((12,), 30, np.int32)
    generate(
        config, params, ids, mask, jax.random.key(3), _sampling(max_new_tokens=60), max_new_tokens_per_seq=limits, **kw
    )
    generate(config, params, ids, mask, jax.random.key(4), _sampling(ignore_eos=True, max_new_tokens=9), **kw)
    total = {k: _compiled()[k] - before[k] for k in before}
    assert total["prefill"] == 1 and total["decode"] <= 3 and total["compact"] <= 2, total


def test_each_program_compiles_while_the_next_is_traced(f32_model):
    """generate hands each of its programs to a compile thread as soon as it is lowered: the first
    one compiles while the later ones are traced and lowered (before, every program was lowered
    first, and the compiles and the persistent cache's loads waited for the last one)."""
    config, params = f32_model
    ids, mask = _prompts(config.vocab_size, width=20)
    spans = {"lower": [], "compile": []}
    kinds = {
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
        "/jax/core/compile/backend_compile_duration": "compile",
    }

    def record(event, start, end, **kw):
        if event in kinds and any(p in str(kw.get("fun_name")) for p in ("_admit", "_decode", "_compact")):
            spans[kinds[event]].append((start, end))

    jax.monitoring.register_event_time_span_listener(record)
    try:  # a new-token bucket of its own: programs not compiled yet
        generate(config, params, ids, mask, jax.random.key(1), _sampling(max_new_tokens=200), group_size=3,
                 options=_options(smaller_rows=(8, 4)))  # fmt: skip
    finally:
        jax.monitoring.unregister_event_time_span_listener(record)
    assert len(spans["lower"]) >= 3 and len(spans["compile"]) == len(spans["lower"]), spans
    first_compile_start = min(start for start, _ in spans["compile"])
    last_lower_end = max(end for _, end in spans["lower"])
    assert first_compile_start < last_lower_end


def test_min_prompt_len_fixes_the_prompt_bucket(f32_model):
    """With min_prompt_len a batch of short prompts runs the programs of the long ones (no compile
    mid-run) and samples what it samples in its own smaller bucket."""
    config, params = f32_model
    long_ids, long_mask = _prompts(config.vocab_size, width=20)  # bucket 32
    short_ids, short_mask = _prompts(config.vocab_size, width=12, seed=1)  # bucket 16 by its longest prompt
    kw = dict(group_size=2, max_batch=8)
    sampling = _sampling(max_new_tokens=100)  # new-token bucket 128: no other test compiles these programs
    fixed = _options(smaller_rows=(4,), min_prompt_len=20)
    generate(config, params, long_ids, long_mask, jax.random.key(5), sampling, **kw, options=fixed)
    before = _compiled()
    padded = generate(config, params, short_ids, short_mask, jax.random.key(6), sampling, **kw, options=fixed)
    assert _compiled() == before  # the bucket-32 programs served the short batch
    own = generate(
        config, params, short_ids, short_mask, jax.random.key(6), sampling, **kw, options=_options(smaller_rows=(4,))
    )
    assert _compiled()["prefill"] == before["prefill"] + 1  # by default: a bucket-16 admission compiled
    _assert_same(padded, own, "min_prompt_len")


# ----------------------------------------------------------------------------- scheduler


def test_scheduler_refills_free_rows_and_compacts_the_tail():
    s = scheduler.Scheduler(20, rows=8, max_batch=8, smaller=(4, 2), refill=2)
    seqs, rows = s.admissions()
    assert seqs.tolist() == list(range(8)) and rows.tolist() == list(range(8))
    assert s.exit_live() == 6  # hand back once 2 rows are free
    live = np.ones(8, bool)
    live[[1, 5]] = False
    assert [x.tolist() for x in s.retire(live)] == [[1, 5], [1, 5]]
    seqs, rows = s.admissions()
    assert seqs.tolist() == [8, 9] and rows.tolist() == [1, 5]
    s.next_seq = 20  # queue drained
    assert s.exit_live() == 4  # now: hand back when the live rows fit the next bucket
    live = np.zeros(8, bool)
    live[[2, 5, 7]] = True
    s.retire(live)
    keep = s.compaction()
    assert keep.tolist() == [2, 5, 7, 0] and s.rows == 4 and s.row_seq.tolist() == [2, 9, 7, -1]
    assert s.smaller == (2,) and s.exit_live() == 2
    assert s.compaction() is None  # 3 live rows do not fit 2


def test_layout_buckets():
    lay = scheduler.layout(256, group_size=8)
    assert (lay.rows, lay.smaller, lay.admit_rows, lay.admit_prompts) == (256, (64, 16), 64, 9)
    assert scheduler.layout(12, group_size=3).rows == 16
    assert scheduler.layout(20, shards=3).rows % 3 == 0
    assert scheduler.rows_candidates(20) == [24, 16, 8, 4, 2, 1]


# ----------------------------------------------------------------------------- memory


def _random_params(config: ModelConfig, dtype=jnp.float32):
    keys = iter(jax.random.split(jax.random.key(0), 32))
    n_layers, d = config.num_hidden_layers, config.hidden_size
    normal = lambda shape: 0.05 * jax.random.normal(next(keys), shape, dtype)  # noqa: E731
    layers = {p: {"w": normal((n_layers, n, k))} for p, (n, k) in projection_shapes(config).items()}
    return {
        "base": {"embed": normal((config.vocab_size, d)), "lm_head": normal((config.vocab_size, d)), "layers": layers},
        "norms": {
            "final_norm": jnp.ones((d,), dtype),
            "layers": {
                "input_layernorm": jnp.ones((n_layers, d), dtype),
                "post_attention_layernorm": jnp.ones((n_layers, d), dtype),
            },
        },
    }


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


def test_memory_estimate_covers_the_compiled_programs():
    """XLA's buffer assignment of the admission, decode and compaction programs (CPU): the cache
    and row state are donated and updated in place (aliased: no second cache, the bug behind the
    old out-of-memory at 256 rows x 2304 slots), and each program's temporaries (and the smaller
    bucket a compaction builds) stay within the estimate's term for it."""
    params = _random_params(SMALL)
    prompt, new = 16, 448
    plan = plan_rollout(SMALL, params, 32, prompt, new, group_size=4, max_batch=32, options=_options())
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
    decode = programs.decode.lower(static, run_params, cache, rows, jax.random.key(0), stop, np.int32(0))
    decode = decode.compile().memory_analysis()
    keep, valid = jnp.zeros((16,), jnp.int32), jnp.ones((16,), bool)
    compact = programs.compact.lower(static, cache, rows, keep, valid).compile().memory_analysis()
    for name, m in (("admit", admit), ("decode", decode)):
        assert m.alias_size_in_bytes >= cache_b + state_bytes, name  # in place
    assert admit.temp_size_in_bytes <= mem.admission
    assert decode.temp_size_in_bytes <= mem.decode
    assert compact.temp_size_in_bytes + compact.output_size_in_bytes <= mem.compaction
    assert decode.temp_size_in_bytes < cache_b / 8  # nothing the size of the cache


def test_rows_are_sized_to_the_budget_and_sample_the_same(f32_model):
    """max_batch=None: the largest row bucket whose estimate (x the margin) fits the budget."""
    config, params = f32_model
    plan_kw = dict(group_size=3, options=_options())
    full = plan_rollout(config, params, 12, 16, 64, max_batch=12, **plan_kw)
    limit = int(full.memory.total * budget.MEMORY_MARGIN) - 1  # all 12 rows just do not fit
    budget_kw = lambda b: dict(group_size=3, options=_options(memory_budget_bytes=b))  # noqa: E731
    auto = plan_rollout(config, params, 12, 16, 64, **budget_kw(limit))
    assert auto.rows < full.rows and auto.memory.total * budget.MEMORY_MARGIN <= limit
    bigger = plan_rollout(config, params, 12, 16, 64, max_batch=auto.rows + 1, **plan_kw)
    assert bigger.memory.total * budget.MEMORY_MARGIN > limit
    ids, mask = _prompts(config.vocab_size)
    key = jax.random.key(5)
    sized = generate(config, params, ids, mask, key, _sampling(), **budget_kw(limit))
    assert plan_rollout(config, params, 12, 16, 64, **budget_kw(limit)).rows == auto.rows  # what the call ran
    _assert_same(sized, generate(config, params, ids, mask, key, _sampling(), **plan_kw), "budget-sized")
    # Later calls of the same shapes keep the rows while they fit (a training step after another
    # compiles nothing new), even where more memory is free; with less, they are sized again.
    roomy = int(full.memory.total * budget.MEMORY_MARGIN) + 2**20
    assert plan_rollout(config, params, 12, 16, 64, **budget_kw(roomy)).rows == auto.rows
    assert plan_rollout(config, params, 10, 16, 64, **budget_kw(roomy)).rows == auto.rows
    tight = int(auto.memory.total * budget.MEMORY_MARGIN) - 1
    assert plan_rollout(config, params, 12, 16, 64, **budget_kw(tight)).rows < auto.rows


def test_memory_plan_uses_the_rollout_estimate():
    """`memory.plan_memory`'s KV cache and rollout activations are the engine's own estimate."""
    from qerl_jax import memory

    plan = memory.plan_memory(SMALL, rollout_batch=64, group_size=8, prompt_len=256, max_new_tokens=2048)
    lay = scheduler.layout(64, group_size=8)
    mem = budget.rollout_memory(
        SMALL, 64, 256, 2048, admit_rows=lay.admit_rows, admit_prompts=lay.admit_prompts, compact_rows=16
    )
    assert plan.kv_cache == mem.kv_cache == cache_bytes(SMALL, 64, 2304)
    assert plan.rollout_activations == mem.row_state + mem.work


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_before_compiling(f32_model):
    config, params = f32_model
    ids, mask = _prompts(config.vocab_size)
    key = jax.random.key(0)
    before = _compiled()
    tiny = RolloutOptions(memory_budget_bytes=50_000)
    with pytest.raises(MemoryError, match="even one sequence.*max_new_tokens"):  # a KV budget too small for 1
        generate(config, params, ids, mask, key, _sampling(), group_size=3, options=tiny)
    with pytest.raises(MemoryError, match="lower max_batch"):
        generate(config, params, ids, mask, key, _sampling(), group_size=3, max_batch=12, options=tiny)
    long_ids = np.ones((1, 256), np.int32)
    with pytest.raises(ValueError, match=r"context \(max_position_embeddings=256\)"):
        generate(config, params, long_ids, np.ones_like(long_ids), key, _sampling())
    with pytest.raises(ValueError, match=r"max_new_tokens_per_seq must be an int array of shape \[12\]"):
        generate(config, params, ids, mask, key, _sampling(), group_size=3, max_new_tokens_per_seq=np.ones(4, np.int32))
    with pytest.raises(ValueError, match=r"max_new_tokens_per_seq must be in \[1, max_new_tokens=24\]"):
        generate(config, params, ids, mask, key, _sampling(), group_size=3, max_new_tokens_per_seq=np.full(12, 25))
    with pytest.raises(ValueError, match="smaller_rows"):
        generate(config, params, ids, mask, key, _sampling(), options=RolloutOptions(smaller_rows=(0,)))
    with pytest.raises(ValueError, match="decode_attention"):
        generate(config, params, ids, mask, key, _sampling(), options=RolloutOptions(decode_attention="flash"))
    with pytest.raises(ValueError, match="max_batch"):
        generate(config, params, ids, mask, key, _sampling(), max_batch=0)
    assert _compiled() == before  # all refused before anything was compiled


def test_decode_program_compiled_for_an_h100_keeps_one_cache(monkeypatch):
    """The decode loop compiled for an H100 (deviceless: XLA's GPU compiler through jax's CUDA
    plugin, skipped where it is not installed) updates its donated cache in place and keeps no
    second one: with `attention`'s einsums instead of `decode_attention_reference`, XLA carried
    the cache in another layout and copied all of it on entry (the old OOM at 256 x 2304)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip("jax's CUDA plugin (jax-cuda12-plugin / -pjrt) is not installed")
    from benchmarks import common
    from benchmarks.devtools import hlo_census

    config = ModelConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
    )
    monkeypatch.setattr(common, "model_config", lambda name: config)
    device = hlo_census.h100_device()
    setup = hlo_census.rollout_setup("test", "bf16", 64, prompt_len=64, new_slots=448, lora_rank=4, device=device)
    cache, state = setup["bucket_args"](64)
    args = (setup["run_params"], cache, state, setup["key"], setup["stop"], setup["scalar"])
    m = programs.decode.trace(setup["static"], *args).lower().compile().memory_analysis()
    cache_b = cache_bytes(config, 64, 512)
    assert m.alias_size_in_bytes >= cache_b
    assert m.temp_size_in_bytes < cache_b / 4, (m.temp_size_in_bytes, cache_b)
