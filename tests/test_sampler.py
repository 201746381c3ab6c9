"""rollout/sampler.py (`generate`): the engine's samples against transformers' generate, a naive
forward loop and a full-forward recompute; stopping, groups and keys; continuous batching (refill,
compaction) against one batch of every sequence, per-sequence token limits, rows sized to the memory
budget; the errors raised before anything is compiled."""

import dataclasses
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from rollout_helpers import (
    assert_same_samples,
    compiled_programs,
    f32_options,
    prompts,
    random_lora,
    recomputed_logp,
)

import qerl_jax
from qerl_jax.rollout import (
    RolloutOptions,
    RolloutPart,
    SamplingConfig,
    budget,
    generate,
    plan_rollout,
    sampler,
    scheduler,
    to_train_batch,
)
from qerl_jax.rollout import batch as rollout_batch

F32 = f32_options()  # exact KV cache for the parity tests

# One sampling setup shared by most tests (max_new_tokens, stop and pad ids are runtime
# arguments of the compiled programs, so they share compilations too).
STOPS = tuple(range(10, 40))  # ~23% of the vocabulary: sampled rows stop within a few dozen tokens
# The batching tests' stops: ~11% of the vocabulary, rows stop at scattered steps, some run to the limit.
BATCHING_STOPS = tuple(range(10, 25))


def _sampling(**kw):
    return SamplingConfig(**{**dict(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=16, eos_ids=()), **kw})


def _batching_sampling(**kw):
    return _sampling(**{"max_new_tokens": 24, "eos_ids": BATCHING_STOPS, **kw})


def _four_prompts(vocab, **kw):
    """4 left-padded prompts (the batching tests: 12 sequences in groups of 3)."""
    return prompts(vocab, **{"pads": (0, 3, 5, 1), **kw})


def _hf_generate(model, ids, mask, max_new, eos=None):
    kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    kwargs.update(eos_token_id=eos) if eos is not None else kwargs.update(min_new_tokens=max_new)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long), **kwargs
        )
    return out.numpy()[:, ids.shape[1] :]


# ----------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("pads", [(0, 0, 0), (0, 3, 5)], ids=["no_padding", "left_padding"])
def test_greedy_matches_transformers_generate(f32_model, pads):
    config, params, hf_model = f32_model
    ids, mask = prompts(config.vocab_size, pads)
    sampling = SamplingConfig(greedy=True, max_new_tokens=12, eos_ids=())
    batch = generate(config, params, ids, mask, jax.random.key(0), sampling, options=F32)
    np.testing.assert_array_equal(np.asarray(batch.tokens), _hf_generate(hf_model, ids, mask, 12))
    assert np.asarray(batch.lengths).tolist() == [12] * len(pads)
    assert np.asarray(batch.truncated).all()


def test_greedy_stops_at_eos_like_transformers(f32_model):
    config, params, hf_model = f32_model
    ids, mask = prompts(config.vocab_size)
    free = _hf_generate(hf_model, ids, mask, 12)
    eos = int(free[1, 4])  # row 1 stops at step 4 (or earlier if the token came before)
    sampling = SamplingConfig(greedy=True, max_new_tokens=12, eos_ids=(eos,), pad_id=0)
    batch = generate(config, params, ids, mask, jax.random.key(0), sampling, options=F32)
    ref = _hf_generate(hf_model, ids, mask, 12, eos=eos)  # pads after EOS, ends when all rows stopped
    tokens = np.asarray(batch.tokens)
    np.testing.assert_array_equal(tokens[:, : ref.shape[1]], ref)
    assert (tokens[:, ref.shape[1] :] == 0).all()
    assert int(batch.steps[0]) == ref.shape[1]
    expected_len = [list(row).index(eos) + 1 if eos in row else 12 for row in free]
    assert np.asarray(batch.lengths).tolist() == expected_len
    assert np.asarray(batch.truncated).tolist() == [eos not in row for row in free]


def _naive_greedy(config, params, ids, mask, steps):
    """Reference: a full forward over the whole sequence per new token, argmax, no cache.

    The sequence buffer is right-padded to its final width, so one program serves every step
    (causal attention: later columns do not change the logits at column t).
    """
    fwd = jax.jit(lambda i, m: qerl_jax.forward(config, params, i, m))
    p = ids.shape[1]
    ids = np.concatenate([ids, np.zeros((ids.shape[0], steps), np.int32)], axis=1)
    mask = np.concatenate([mask, np.ones((mask.shape[0], steps), np.int32)], axis=1)
    for t in range(steps):
        ids[:, p + t] = np.argmax(np.asarray(fwd(ids, mask))[:, p + t - 1], axis=-1)
    return ids[:, p:]


def test_nvfp4_greedy_matches_naive_forward_loop(tiny_qwen2_dir, f32_model):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32", quant="nvfp4")
    assert params["base"]["layers"]["q_proj"]["w"].fmt == "nvfp4"
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(greedy=True, max_new_tokens=10, eos_ids=())
    batch = generate(config, params, ids, mask, jax.random.key(0), sampling, options=F32)
    np.testing.assert_array_equal(np.asarray(batch.tokens), _naive_greedy(config, params, ids, mask, 10))
    dense = generate(*f32_model[:2], ids, mask, jax.random.key(0), sampling, options=F32)
    assert not np.array_equal(np.asarray(dense.tokens), np.asarray(batch.tokens))  # the 4-bit weights are used


# ----------------------------------------------------------------------------- log-prob invariant


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_sampled_logprobs_equal_full_forward_recompute(f32_model, with_lora):
    config, params, _ = f32_model
    lora_scale = 0.5
    if with_lora:
        params = {**params, "lora": random_lora(config)}
    ids, mask = prompts(config.vocab_size)
    sampling = _sampling(eos_ids=STOPS[:10])
    batch = generate(
        config,
        params,
        ids,
        mask,
        jax.random.key(1),
        sampling,
        group_size=2,
        lora_scale=lora_scale,
        options=F32,
    )
    recomputed, old, resp = recomputed_logp(config, params, batch, 0.8, lora_scale)
    assert resp.sum() == int(np.asarray(batch.lengths).sum())
    np.testing.assert_allclose(old[resp == 1], recomputed[resp == 1], atol=2e-4)
    if with_lora:  # the adapters must change the policy, or this case tests nothing new
        plain = generate(
            config,
            {k: v for k, v in params.items() if k != "lora"},
            ids,
            mask,
            jax.random.key(1),
            sampling,
            group_size=2,
            options=F32,
        )
        assert not np.array_equal(np.asarray(plain.tokens), np.asarray(batch.tokens))


def test_bf16_nvfp4_logprobs_close_to_full_forward(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    params = {**params, "lora": jax.tree.map(lambda x: x.astype(jnp.bfloat16), random_lora(config))}
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16, eos_ids=())
    batch = generate(config, params, ids, mask, jax.random.key(2), sampling, lora_scale=0.5)
    recomputed, old, resp = recomputed_logp(config, params, batch, 1.0, 0.5)
    err = np.abs(old - recomputed)[resp == 1]
    assert err.mean() < 0.02 and err.max() < 0.15, (err.mean(), err.max())


def test_nvfp4_sampler_train_log_ratio_is_no_larger_than_bf16s(tiny_qwen2_dir):
    """Sampler vs train forward, mean |log ratio| of the sampled tokens, Pallas backend: the NVFP4
    train forward rounds each projection once (float32 kernel product + bias + LoRA), as the bf16
    path and the sampler do, so its mismatch is no larger than bf16's (with the product rounded
    to bf16 before the adds it was 2e4x here)."""
    path, _ = tiny_qwen2_dir
    ids, mask = prompts(64)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16, eos_ids=())
    forward = jax.jit(qerl_jax.forward, static_argnums=0, static_argnames=("lora_scale", "backend"))
    mean_err = {}
    for quant in (None, "nvfp4"):
        config, params = qerl_jax.load_model(path, dtype="bfloat16", quant=quant)
        params = {**params, "lora": jax.tree.map(lambda x: x.astype(jnp.bfloat16), random_lora(config))}
        opts = RolloutOptions(backend="pallas")
        batch = generate(config, params, ids, mask, jax.random.key(2), sampling, lora_scale=0.5, options=opts)
        train = to_train_batch(batch)
        logits = forward(config, params, train["input_ids"], train["attention_mask"], lora_scale=0.5, backend="pallas")
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), train["input_ids"][:, 1:, None], axis=-1)[..., 0]
        resp = np.asarray(train["response_mask"][:, 1:]) == 1
        mean_err[quant] = float(np.abs(np.asarray(logp) - np.asarray(train["old_logp"][:, 1:]))[resp].mean())
    # here both are ~6e-8 (the sampler's bf16 KV cache is exact for this model); twice rounded: 1.3e-3
    assert mean_err["nvfp4"] <= 1.5 * mean_err[None] + 1e-5, mean_err


# ----------------------------------------------------------------------------- stopping, groups


def test_eos_stopping_masks_and_early_exit(f32_model):
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size)
    stop = STOPS
    sampling = _sampling(max_new_tokens=48, eos_ids=stop, pad_id=0)
    batch = generate(config, params, ids, mask, jax.random.key(4), sampling, group_size=2, options=F32)
    tokens, logp = np.asarray(batch.tokens), np.asarray(batch.logprobs)
    lengths, resp = np.asarray(batch.lengths), np.asarray(batch.response_mask)
    assert tokens.shape == (6, 48) and np.asarray(batch.prompt_index).tolist() == [0, 0, 1, 1, 2, 2]
    for row in range(6):
        hits = np.flatnonzero(np.isin(tokens[row], stop))
        assert hits.size and lengths[row] == hits[0] + 1
        assert (tokens[row, lengths[row] :] == 0).all() and (logp[row, lengths[row] :] == 0).all()
        assert (logp[row, : lengths[row]] < 0).all()
        assert resp[row].tolist() == [1] * lengths[row] + [0] * (48 - lengths[row])
    assert not np.asarray(batch.truncated).any()
    assert len(set(lengths.tolist())) > 1  # rows stopped at different steps
    assert int(batch.steps[0]) == lengths.max() < 48  # the loop ended when the last row stopped


def test_ignore_eos_runs_to_max_new_tokens(f32_model):
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size)
    sampling = _sampling(max_new_tokens=20, eos_ids=STOPS, ignore_eos=True)
    batch = generate(config, params, ids, mask, jax.random.key(4), sampling, group_size=2, options=F32)
    assert np.asarray(batch.lengths).tolist() == [20] * 6 and int(batch.steps[0]) == 20
    assert np.isin(np.asarray(batch.tokens), range(10, 40)).any()  # stop ids were sampled, not obeyed
    assert np.asarray(batch.truncated).all()


def test_group_sharing_chunking_and_repeats_give_identical_samples(f32_model):
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size)
    sampling = _sampling(max_new_tokens=10, eos_ids=STOPS[:10])
    kw = dict(options=F32)
    key = jax.random.key(5)
    shared = generate(config, params, ids, mask, key, sampling, group_size=2, **kw)
    variants = {
        "repeated_prompts": generate(config, params, np.repeat(ids, 2, 0), np.repeat(mask, 2, 0), key, sampling, **kw),
        "no_sharing": generate(
            config,
            params,
            ids,
            mask,
            key,
            sampling,
            group_size=2,
            options=dataclasses.replace(F32, share_prefill=False),
        ),
        "split_groups": generate(config, params, ids, mask, key, sampling, group_size=2, max_batch=1, **kw),
        "chunks_of_4": generate(config, params, ids, mask, key, sampling, group_size=2, max_batch=5, **kw),
    }
    samples = np.asarray(shared.tokens).reshape(3, 2, -1)
    assert not (samples[:, :1] == samples).all()  # the G samples of a prompt differ
    for name, other in variants.items():
        np.testing.assert_array_equal(np.asarray(other.tokens), np.asarray(shared.tokens), err_msg=name)
        np.testing.assert_allclose(np.asarray(other.logprobs), np.asarray(shared.logprobs), atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(np.asarray(other.lengths), np.asarray(shared.lengths), err_msg=name)
    assert variants["split_groups"].steps.shape == (6,) and variants["chunks_of_4"].steps.shape == (2,)


def test_same_key_same_samples_different_key_different_samples(f32_model):
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size)
    sampling = _sampling(max_new_tokens=10, eos_ids=STOPS[:10])
    a = generate(config, params, ids, mask, jax.random.key(5), sampling, group_size=2, options=F32)
    b = generate(config, params, ids, mask, jax.random.key(5), sampling, group_size=2, options=F32)
    c = generate(config, params, ids, mask, jax.random.key(6), sampling, group_size=2, options=F32)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


# ----------------------------------------------------------------------------- continuous = fixed


def test_continuous_batching_samples_what_one_batch_samples(f32_model):
    """4 prompts x 3 samples: every row count draws the same tokens, log-probs and lengths per
    sequence, with max_batch below (groups split across refills), equal to and above B * G, rows
    stopping mid-run (EOS) and at the limit, and the tail compacted into smaller buckets."""
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size)
    key = jax.random.key(7)
    fixed = generate(
        config, params, ids, mask, key, _batching_sampling(), group_size=3, options=f32_options(smaller_rows=())
    )
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
        opts = f32_options(smaller_rows=smaller)
        other = generate(
            config, params, ids, mask, key, _batching_sampling(), group_size=3, max_batch=max_batch, options=opts
        )
        assert_same_samples(other, fixed, name)
        if name.startswith("max_batch 5"):  # 12 sequences through 5 rows: refilled as they stop
            assert other.steps.shape[0] > 3
            assert plan_rollout(config, params, 12, 16, 64, group_size=3, max_batch=5, options=opts).rows == 8
        if name == "all rows, compacted":
            assert other.steps.shape[0] > 1  # compacted: the tail ran in smaller buckets
            assert plan_rollout(config, params, 12, 16, 64, group_size=3, options=opts).rows == 16


def test_segment_seconds_split_the_loop_into_host_work_and_the_segments(f32_model, monkeypatch):
    """Host work between segments (here a slow retire: the scheduler's step after each segment) counts
    as host seconds, a slow segment (its dispatch held, as XLA's while loop holds it on a GPU) as the
    segment's; both inside the call's wall time."""
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size)
    opts = f32_options(smaller_rows=(4, 2))
    args = (config, params, ids, mask, jax.random.key(7), _batching_sampling())
    generate(*args, group_size=3, max_batch=5, options=opts)  # compiled before the timed call
    retire, decode = scheduler.Scheduler.retire, sampler.programs.decode

    def slow_retire(self, live):
        time.sleep(0.05)
        return retire(self, live)

    def slow_decode(*a, **kw):
        time.sleep(0.03)
        return decode(*a, **kw)

    slow_decode.trace = decode.trace
    monkeypatch.setattr(scheduler.Scheduler, "retire", slow_retire)
    monkeypatch.setattr(sampler.programs, "decode", slow_decode)
    t0 = time.perf_counter()
    batch = generate(*args, group_size=3, max_batch=5, options=opts)
    wall = time.perf_counter() - t0
    seconds, segments = np.asarray(batch.segment_s), batch.steps.shape[0]
    assert seconds.shape == (segments, 2) and segments > 3 and (seconds >= 0).all()
    host, device = seconds.sum(axis=0)
    assert host >= 0.05 * segments and device >= 0.03 * segments  # every retire's sleep, the last one's too
    assert (seconds[:, 1] >= 0.03).all()
    assert host + device <= wall
    rows = np.asarray(batch.segment_rows).tolist()  # 8 rows (5 sequences at once), the tail in 4, then 2
    assert len(rows) == segments and rows[0] == 8 and rows == sorted(rows, reverse=True) and rows[-1] < 8


def test_per_sequence_token_limits(f32_model):
    """max_new_tokens_per_seq stops each sequence at its own limit, marked truncated; its tokens
    are the prefix of the same sequence without the limit (its own PRNG stream)."""
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size)
    kw = dict(group_size=3, max_batch=5, options=f32_options(smaller_rows=(4, 2)))
    key = jax.random.key(8)
    free = generate(config, params, ids, mask, key, _batching_sampling(eos_ids=()), **kw)
    limits = np.array([1, 2, 3, 24, 5, 8, 13, 21, 7, 1, 16, 4], np.int32)
    capped = generate(
        config, params, ids, mask, key, _batching_sampling(eos_ids=()), max_new_tokens_per_seq=limits, **kw
    )
    assert np.asarray(capped.lengths).tolist() == limits.tolist()
    assert np.asarray(capped.truncated).all()
    tokens, free_tokens = np.asarray(capped.tokens), np.asarray(free.tokens)
    for row, limit in enumerate(limits):
        np.testing.assert_array_equal(tokens[row, :limit], free_tokens[row, :limit])
        assert (tokens[row, limit:] == 0).all()
        assert (np.asarray(capped.response_mask)[row] == (np.arange(24) < limit)).all()
    # With stop ids, a sequence ends at the earlier of its stop and its limit.
    stopped = generate(config, params, ids, mask, key, _batching_sampling(), **kw)
    both = generate(config, params, ids, mask, key, _batching_sampling(), max_new_tokens_per_seq=limits, **kw)
    expected = np.minimum(np.asarray(stopped.lengths), limits)
    assert np.asarray(both.lengths).tolist() == expected.tolist()
    hit_stop = np.asarray(stopped.lengths) <= limits
    np.testing.assert_array_equal(np.asarray(both.truncated), ~(hit_stop & ~np.asarray(stopped.truncated)))


def test_unshared_prefill_samples_the_same(f32_model):
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size)
    kw = dict(group_size=3, max_batch=5)
    key = jax.random.key(9)
    ref = generate(config, params, ids, mask, key, _batching_sampling(), **kw, options=f32_options(smaller_rows=(4,)))
    unshared = f32_options(smaller_rows=(4,), share_prefill=False)
    assert_same_samples(
        generate(config, params, ids, mask, key, _batching_sampling(), **kw, options=unshared), ref, "unshared"
    )


def test_each_program_compiles_while_the_next_is_traced(f32_model):
    """generate hands each of its programs to a compile thread as soon as it is lowered: the first
    one compiles while the later ones are traced and lowered (before, every program was lowered
    first, and the compiles and the persistent cache's loads waited for the last one)."""
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size, width=20)
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
        generate(config, params, ids, mask, jax.random.key(1), _batching_sampling(max_new_tokens=200), group_size=3,
                 options=f32_options(smaller_rows=(8, 4)))  # fmt: skip
    finally:
        jax.monitoring.unregister_event_time_span_listener(record)
    assert len(spans["lower"]) >= 3 and len(spans["compile"]) == len(spans["lower"]), spans
    first_compile_start = min(start for start, _ in spans["compile"])
    last_lower_end = max(end for _, end in spans["lower"])
    assert first_compile_start < last_lower_end


def test_params_committed_to_a_device_compile_nothing_in_the_decode_loop(f32_model):
    """A data shard's view of the params is committed to its device (`rollout.data_parallel`), so
    jit commits the cache and rows there too: the programs are precompiled with that placement
    and the decode loop compiles nothing (before, each program compiled again in the loop, one
    after another: 5-6 s each for the 1.5B on a GPU)."""
    config, params, _ = f32_model
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "model"))
    committed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    ids, mask = _four_prompts(config.vocab_size, width=20)
    in_loop = []
    caller = threading.current_thread()

    def record(event, duration, **kw):
        name = str(kw.get("fun_name"))
        if event == "/jax/core/compile/backend_compile_duration" and threading.current_thread() is caller:
            if any(p in name for p in ("_admit", "_decode", "_compact")):
                in_loop.append(name)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:  # a new-token bucket of its own (176): programs not compiled yet
        batch = generate(config, committed, ids, mask, jax.random.key(1), _batching_sampling(max_new_tokens=176),
                         group_size=3, options=f32_options(smaller_rows=(8, 4)))  # fmt: skip
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert int(np.asarray(batch.steps).sum()) > 0
    assert in_loop == [], in_loop


def test_min_prompt_len_fixes_the_prompt_bucket(f32_model):
    """With min_prompt_len a batch of short prompts runs the programs of the long ones (no compile
    mid-run) and samples what it samples in its own smaller bucket."""
    config, params, _ = f32_model
    long_ids, long_mask = _four_prompts(config.vocab_size, width=20)  # bucket 32
    short_ids, short_mask = _four_prompts(config.vocab_size, width=12, seed=1)  # bucket 16 by its longest prompt
    kw = dict(group_size=2, max_batch=8)
    sampling = _batching_sampling(max_new_tokens=100)  # new-token bucket 128: no other test compiles these programs
    fixed = f32_options(smaller_rows=(4,), min_prompt_len=20)
    generate(config, params, long_ids, long_mask, jax.random.key(5), sampling, **kw, options=fixed)
    before = compiled_programs()
    padded = generate(config, params, short_ids, short_mask, jax.random.key(6), sampling, **kw, options=fixed)
    assert compiled_programs() == before  # the bucket-32 programs served the short batch
    own = generate(
        config, params, short_ids, short_mask, jax.random.key(6), sampling, **kw, options=f32_options(smaller_rows=(4,))
    )
    assert compiled_programs()["prefill"] == before["prefill"] + 1  # by default: a bucket-16 admission compiled
    assert_same_samples(padded, own, "min_prompt_len")


def test_rows_are_sized_to_the_budget_and_sample_the_same(f32_model):
    """max_batch=None: the largest row bucket whose estimate (x the margin) fits the budget."""
    config, params, _ = f32_model
    plan_kw = dict(group_size=3, options=f32_options())
    full = plan_rollout(config, params, 12, 16, 64, max_batch=12, **plan_kw)
    limit = int(full.memory.total * budget.MEMORY_MARGIN) - 1  # all 12 rows just do not fit
    budget_kw = lambda b: dict(group_size=3, options=f32_options(memory_budget_bytes=b))  # noqa: E731
    auto = plan_rollout(config, params, 12, 16, 64, **budget_kw(limit))
    assert auto.rows < full.rows and auto.memory.total * budget.MEMORY_MARGIN <= limit
    bigger = plan_rollout(config, params, 12, 16, 64, max_batch=auto.rows + 1, **plan_kw)
    assert bigger.memory.total * budget.MEMORY_MARGIN > limit
    ids, mask = _four_prompts(config.vocab_size)
    key = jax.random.key(5)
    sized = generate(config, params, ids, mask, key, _batching_sampling(), **budget_kw(limit))
    assert plan_rollout(config, params, 12, 16, 64, **budget_kw(limit)).rows == auto.rows  # what the call ran
    assert_same_samples(
        sized, generate(config, params, ids, mask, key, _batching_sampling(), **plan_kw), "budget-sized"
    )
    # Later calls of the same shapes keep the rows while they fit (a training step after another
    # compiles nothing new), even where more memory is free; with less, they are sized again.
    roomy = int(full.memory.total * budget.MEMORY_MARGIN) + 2**20
    assert plan_rollout(config, params, 12, 16, 64, **budget_kw(roomy)).rows == auto.rows
    assert plan_rollout(config, params, 10, 16, 64, **budget_kw(roomy)).rows == auto.rows
    tight = int(auto.memory.total * budget.MEMORY_MARGIN) - 1
    assert plan_rollout(config, params, 12, 16, 64, **budget_kw(tight)).rows < auto.rows


# ----------------------------------------------------------------------------- bad input


def test_rejects_bad_prompts(f32_model):
    config, params, _ = f32_model
    key = jax.random.key(0)
    sampling = SamplingConfig(max_new_tokens=8)
    ids, mask = prompts(config.vocab_size)
    empty = mask.copy()
    empty[1] = 0
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] have no real token"):
        generate(config, params, ids, empty, key, sampling)
    right = mask[:, ::-1].copy()
    with pytest.raises(ValueError, match="left-padded"):
        generate(config, params, ids, right, key, sampling)
    with pytest.raises(ValueError, match="prompt_mask shape"):
        generate(config, params, ids, mask[:, 1:], key, sampling)
    with pytest.raises(ValueError, match=r"\[batch, prompt_len\]"):
        generate(config, params, ids[0], mask[0], key, sampling)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(config, params, ids + config.vocab_size, mask, key, sampling)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        long_ids = np.ones((1, 250), np.int32)
        generate(config, params, long_ids, np.ones_like(long_ids), key, SamplingConfig(max_new_tokens=7))
    with pytest.raises(ValueError, match="group_size"):
        generate(config, params, ids, mask, key, sampling, group_size=0)
    with pytest.raises(ValueError, match="empty"):
        generate(config, params, ids[:0], mask[:0], key, sampling)


def test_over_memory_budget_says_what_to_lower(f32_model):
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size)
    with pytest.raises(MemoryError, match="lower max_batch.*group size.*max_new_tokens"):
        generate(
            config,
            params,
            ids,
            mask,
            jax.random.key(0),
            SamplingConfig(max_new_tokens=8),
            group_size=4,
            max_batch=12,  # all rows at once (max_batch=None sizes them to the budget: below)
            options=RolloutOptions(memory_budget_bytes=10_000),
        )


def test_bad_input_is_refused_before_compiling(f32_model):
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size)
    key = jax.random.key(0)
    before = compiled_programs()
    tiny = RolloutOptions(memory_budget_bytes=50_000)
    with pytest.raises(MemoryError, match="even one sequence.*max_new_tokens.*mesh.model.*XLA_PYTHON_CLIENT_MEM_FRACTION"):  # a KV budget too small for 1
        generate(config, params, ids, mask, key, _batching_sampling(), group_size=3, options=tiny)
    with pytest.raises(MemoryError, match="lower max_batch"):
        generate(config, params, ids, mask, key, _batching_sampling(), group_size=3, max_batch=12, options=tiny)
    long_ids = np.ones((1, 256), np.int32)
    with pytest.raises(ValueError, match=r"context \(max_position_embeddings=256\)"):
        generate(config, params, long_ids, np.ones_like(long_ids), key, _batching_sampling())
    with pytest.raises(ValueError, match=r"max_new_tokens_per_seq must be an int array of shape \[12\]"):
        generate(
            config,
            params,
            ids,
            mask,
            key,
            _batching_sampling(),
            group_size=3,
            max_new_tokens_per_seq=np.ones(4, np.int32),
        )
    with pytest.raises(ValueError, match=r"max_new_tokens_per_seq must be in \[1, max_new_tokens=24\]"):
        generate(
            config, params, ids, mask, key, _batching_sampling(), group_size=3, max_new_tokens_per_seq=np.full(12, 25)
        )
    with pytest.raises(ValueError, match="smaller_rows"):
        generate(config, params, ids, mask, key, _batching_sampling(), options=RolloutOptions(smaller_rows=(0,)))
    with pytest.raises(ValueError, match="decode_attention"):
        generate(config, params, ids, mask, key, _batching_sampling(), options=RolloutOptions(decode_attention="flash"))
    with pytest.raises(ValueError, match="max_batch"):
        generate(config, params, ids, mask, key, _batching_sampling(), max_batch=0)
    assert compiled_programs() == before  # all refused before anything was compiled


class _Monitor:
    """Admits the first `limit` sequences, then all; once `drop_after` sequences have stopped,
    drops every sequence at or past `end` (queued or decoding)."""

    def __init__(self, limit, end, drop_after):
        self.limit, self.end, self.drop_after = limit, None, drop_after
        self.final_end, self.stopped = end, []

    def finished(self, seqs, tokens, lengths):
        assert (lengths > 0).all() and tokens.shape[0] == len(seqs)
        self.stopped += seqs.tolist()

    def bounds(self, wait):
        if len(self.stopped) >= self.drop_after:
            self.end = self.final_end
        if wait and self.limit < 12:  # the queue waits on us: let the rest in
            self.limit = 12
        return self.limit, self.end if self.end is not None else 12


def test_monitor_bounds_admissions_and_drops_sequences_mid_run(f32_model):
    """A monitor holding the queue, then dropping sequences 6.. mid-run (some decoding): the rows
    it keeps draw what a plain call draws; dropped rows are empty; a call on some rows with their
    streams draws what the whole call draws for them."""
    config, params, _ = f32_model
    ids, mask = _four_prompts(config.vocab_size)
    key = jax.random.key(7)
    plain = generate(config, params, ids, mask, key, _batching_sampling(), group_size=3, options=f32_options())
    monitor = _Monitor(limit=4, end=6, drop_after=7)
    got = generate(
        config, params, ids, mask, key, _batching_sampling(), group_size=3, max_batch=4,
        part=RolloutPart(monitor=monitor), options=f32_options(smaller_rows=(2,)),
    )  # fmt: skip
    assert sorted(monitor.stopped)[:6] == list(range(6)) and len(monitor.stopped) < 12
    lengths, decoded = np.asarray(got.lengths), np.asarray(got.decoded)
    assert (lengths[6:] == 0).any()  # some dropped before they stopped
    finished = lengths > 0
    np.testing.assert_array_equal(decoded[finished], lengths[finished])
    assert (decoded[~finished] > 0).any()  # dropped while decoding: their partial tokens counted
    np.testing.assert_array_equal(np.asarray(plain.decoded), np.asarray(plain.lengths))
    first = np.arange(6)
    assert_same_samples(rollout_batch.select_rows(got, first), rollout_batch.select_rows(plain, first), "kept rows")
    rows = np.arange(6, 12)
    part = generate(
        config, params, ids[2:], mask[2:], key, _batching_sampling(), group_size=3, part=RolloutPart(streams=rows),
        options=f32_options(),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(part.tokens), np.asarray(plain.tokens)[6:])


def test_resumed_sequences_go_longest_first_in_programs_sized_to_their_span():
    """`_resume_chunks`: every sequence once, the longest first; each program's span holds its longest
    sequence's tokens, and its rows fill an admission's prompt tokens (P * admit_prompts)."""
    call = types.SimpleNamespace(prompt_slots=256, static=types.SimpleNamespace(new_slots=2048))
    plan = types.SimpleNamespace(admit_rows=64, admit_prompts=8)
    lengths = np.array([5, 1500, 70, 700, 64, 65, 2000, 3])
    chunks = sampler._resume_chunks(call, plan, lengths)
    order = np.concatenate([c for c, _, _ in chunks])
    assert sorted(order.tolist()) == list(range(8)) and (np.diff(lengths[order]) <= 0).all()
    for chunk, span, k in chunks:
        assert len(chunk) <= k == max(1, min(64, 8 * 256 // (256 + span)))
        assert lengths[chunk].max() - 1 <= span and (span == 2048 or lengths[chunk].max() - 1 > span // 2 or span == 64)
    # 1 row a program at 2048 and 1024 (2304 and 1280 slots), 5 at 128: the 70-token one and the four shorter
    assert [(len(c), span) for c, span, _ in chunks] == [(1, 2048), (1, 2048), (1, 1024), (5, 128)]
