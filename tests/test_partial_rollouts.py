"""Partial rollouts (`rollout.max_staleness`): a call paused mid-decode and resumed by later calls draws
what one uninterrupted call draws; the step's carried groups, their forced finish, their metrics and
their round trip through a checkpoint."""

import jax
import numpy as np
import pytest
from rollout_helpers import f32_options, prompts

from qerl_jax.rollout import SamplingConfig, generate, sampler

BATCHING_STOPS = tuple(range(10, 25))  # test_sampler's: rows stop at scattered steps, some run to the limit


def _sampling(max_new_tokens=24, eos_ids=BATCHING_STOPS):
    return SamplingConfig(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=max_new_tokens, eos_ids=eos_ids)


class _PauseAfter:
    """Says `done` at its `checks`-th question: the call pauses there."""

    def __init__(self, checks):
        self.checks, self.stopped = checks, []

    def finished(self, seqs, tokens, lengths):
        assert (lengths > 0).all()
        self.stopped += seqs.tolist()

    def bounds(self, wait):
        return 12, 12

    def done(self):
        self.checks -= 1
        return self.checks <= 0


def _next_partial(batch, paused):
    """The sequences the next call carries: the finished ones of `batch` and the `paused` ones."""
    lengths = np.asarray(batch.lengths)
    done = np.flatnonzero(lengths > 0)
    return sampler.Partial(
        seqs_K=np.concatenate([done, paused.seqs_K]),
        tokens_KxM=np.concatenate([np.asarray(batch.tokens)[done], paused.tokens_KxM]),
        logprobs_KxM=np.concatenate([np.asarray(batch.logprobs)[done], paused.logprobs_KxM]),
        lengths_K=np.concatenate([lengths[done], paused.lengths_K]),
        finished_K=np.concatenate([np.ones(len(done), bool), paused.finished_K]),
        stopped_K=np.concatenate([~np.asarray(batch.truncated)[done], paused.stopped_K]),
    )


@pytest.mark.parametrize(
    "max_new, stops, checks, spans",
    [
        (24, BATCHING_STOPS, 3, {64}),  # a 64-slot response buffer: every re-prefill spans all of it
        # a 128-slot buffer, rare stops, pauses every ~32 steps: re-prefills of 64 slots and of 128
        (100, (10, 11), 8, {64, 128}),
    ],
)
def test_paused_and_resumed_calls_draw_what_one_call_draws(f32_model, monkeypatch, max_new, stops, checks, spans):
    """Calls paused every few decode steps (rows decoding, rows never admitted), each resuming the last
    one's sequences (re-prefilled over the span their tokens need, in rows other sequences held) under
    the same weights and key: the tokens of one uninterrupted call, their log-probs to float32 rounding;
    the finished ones reported to the monitor at once. The re-admission programs (one per span) are
    compiled ahead with the others, all of them in the first call (which carries nothing), never
    inside the decode loop."""
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size, pads=(0, 3, 5, 1))
    key = jax.random.key(7)
    sampling = _sampling(max_new, stops)
    plain = generate(config, params, ids, mask, key, sampling, group_size=3, options=f32_options())
    spans_run = set()
    chunks = sampler._resume_chunks

    def recorded_chunks(*args):
        out = chunks(*args)
        spans_run.update(span for _, span, _ in out)
        return out

    monkeypatch.setattr(sampler, "_resume_chunks", recorded_chunks)
    monkeypatch.setattr(sampler, "MONITOR_STEPS", 4)
    resume_traced = {"ahead": 0, "in_loop": 0}
    in_loop = [False]
    decode_all = sampler._decode_all

    def watched_decode_all(*args, **kwargs):
        in_loop[0] = True
        try:
            return decode_all(*args, **kwargs)
        finally:
            in_loop[0] = False

    def record(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration" and "_resume" in str(kw.get("fun_name")):
            resume_traced["in_loop" if in_loop[0] else "ahead"] += 1

    monkeypatch.setattr(sampler, "_decode_all", watched_decode_all)
    jax.monitoring.register_event_duration_secs_listener(record)
    partial = sampler.Partial.empty(max_new)
    calls, paused_ever = 0, 0
    while len(partial.seqs_K) < 12 or not partial.finished_K.all():
        monitor = _PauseAfter(checks=checks)
        batch, paused = generate(
            config, params, ids, mask, key, sampling, group_size=3, max_batch=4,
            part=sampler.RolloutPart(monitor=monitor, partial=partial), options=f32_options(smaller_rows=(2,)),
        )  # fmt: skip
        # the finished carried ones were reported first
        assert monitor.stopped[: int(partial.finished_K.sum())] == partial.seqs_K[partial.finished_K].tolist()
        lengths = np.asarray(batch.lengths)
        assert (lengths[paused.seqs_K] == 0).all() and (paused.lengths_K >= 1).all()
        np.testing.assert_array_equal(np.asarray(batch.decoded)[paused.seqs_K], paused.lengths_K)
        paused_ever += len(paused.seqs_K)
        if calls == 0:
            never = (lengths == 0) & ~np.isin(np.arange(12), paused.seqs_K)
            assert never.any(), "the first call must leave sequences it never admitted"
            # the first call carried nothing, yet compiled the re-admission of every span ahead
            assert resume_traced == {"ahead": len(spans), "in_loop": 0}, resume_traced
        partial, calls = _next_partial(batch, paused), calls + 1
        assert calls < 12
    jax.monitoring.unregister_event_duration_listener(record)
    assert spans_run == spans
    assert resume_traced == {"ahead": len(spans), "in_loop": 0}, resume_traced
    assert calls >= 3 and paused_ever >= 4
    order = np.argsort(partial.seqs_K)
    np.testing.assert_array_equal(partial.lengths_K[order], np.asarray(plain.lengths))
    np.testing.assert_array_equal(partial.tokens_KxM[order], np.asarray(plain.tokens))
    np.testing.assert_allclose(partial.logprobs_KxM[order], np.asarray(plain.logprobs), atol=2e-5)
    np.testing.assert_array_equal(partial.stopped_K[order], ~np.asarray(plain.truncated))


# ----------------------------------------------------------------------------- a step's carried groups

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

from conftest import load_config, set_fields  # noqa: E402
from rollout_helpers import recomputed_logp  # noqa: E402

from qerl_jax import experience, lora, partial_rollouts, reward_pool, rewards, run_config  # noqa: E402
from qerl_jax.data import PromptLoader, load_math_dataset  # noqa: E402
from qerl_jax.policy import load_policy  # noqa: E402

STOPS = tuple(range(40, 120))  # stop ids the tiny model draws now and then: completions of scattered lengths


def _stopping_sampling(cfg, policy):
    return dataclasses.replace(run_config.sampling_config(cfg, policy), eos_ids=STOPS)


def _tiny_run(workdir, model_dir, **overrides):
    cfg = load_config("tiny")
    cfg.workdir, cfg.model.tiny, cfg.model.path, cfg.eval.num_examples = str(workdir), False, model_dir, 0
    return run_config.from_config_dict(set_fields(cfg, overrides))


def test_steps_carry_paused_groups_force_the_old_ones_and_train_each_token_with_its_sampler_logp(
    tmp_path, tiny_model_dir, monkeypatch
):
    """K = 1, three steps on the same weights: the first pauses groups mid-decode (and leaves samples
    never admitted); each later one finishes every group carried from the step before (counted) before
    it ends and keeps them all (carried first), logs their off-policy share and staleness (never past
    K); at most T - 4 started groups are carried (T = 6 in flight, carried ones included); every kept
    row's tokens, sampler log-probs and reward belong to its prompt (recomputed); the loader moves past
    the batches a group started from, and no prompt it handed out is lost: each was trained or is in
    the carry, the unstarted ones too; the carry's JSON round trip (unstarted groups included)
    continues the run the same."""
    monkeypatch.setattr(experience, "sampling_config", _stopping_sampling)
    monkeypatch.setattr(sampler, "MONITOR_STEPS", 4)
    cfg = _tiny_run(tmp_path, tiny_model_dir, **{"rollout.max_staleness": 1, "rollout.max_batch": 6})
    policy = load_policy(cfg)
    dataset = load_math_dataset(cfg.data.train)
    loader = PromptLoader(dataset, cfg.rollout.prompts_per_step, seed=0)
    carry, key, batches, trained, unstarted_ever = [], jax.random.key(5), 0, [], 0
    assert partial_rollouts.in_flight(4, 1.0, dynamic=False) == 6
    with reward_pool.RewardPool(1) as pool:
        for step in range(3):
            before = list(carry)
            exp, stats, carry = partial_rollouts.collect_partial(
                cfg, policy, policy.frozen, loader, pool, jax.random.fold_in(key, step), carry, step, max_batch=6
            )
            batches += int(stats["rollout/prompt_batches"])
            held = lambda groups: sum(len(t) for c in groups for t in c.tokens)  # noqa: E731
            decoded = int(np.asarray(exp.rollout.lengths).sum()) + held(carry) - held(before)  # all kept or carried
            assert stats["rollout/decoded_tokens"] == decoded > 0
            assert loader.state()["step"] == batches
            assert exp.groups_kept == stats["rollout/groups_kept"] == 4
            trained += exp.prompts[::4]
            started = [c for c in carry if c.since is not None]
            unstarted = [c for c in carry if c.since is None]
            assert stats["rollout/carried_groups"] == len(started) <= 6 - 4
            assert stats["rollout/unstarted_groups"] == len(unstarted)
            assert all(not any(c.tokens) for c in unstarted) and all(any(c.tokens) for c in started)
            unstarted_ever += len(unstarted)
            forced = [c for c in before if c.since is not None]
            assert stats["rollout/forced_groups"] == len(forced)  # K = 1: every started carried group must finish
            unfinished = [len(t) for c in forced for t, done in zip(c.tokens, c.finished) if not done]
            assert stats["rollout/resumed_tokens"] == sum(unfinished) and (sum(unfinished) > 0) == bool(forced)
            assert all(c.since == step for c in started)  # ... and did: none is carried twice
            assert {c.prompt for c in forced} <= set(exp.prompts)  # ... and was kept
            assert stats["rollout/staleness_max"] == (1.0 if forced else 0.0)
            if step == 0:
                assert stats["rollout/offpolicy_tokens_frac"] == 0.0
                samples = [(len(t), f) for c in carry for t, f in zip(c.tokens, c.finished)]
                assert any(n > 0 and not f for n, f in samples) and any(n == 0 for n, _ in samples)
            elif forced:
                assert 0.0 < stats["rollout/offpolicy_tokens_frac"] < 1.0
                kept = [r for r, p in enumerate(exp.prompts) if p in {c.prompt for c in forced}]
                assert (np.asarray(exp.rollout.lengths)[kept] > 0).all()  # ... complete
            lengths = np.asarray(exp.rollout.lengths)
            assert (lengths > 0).all() and len(exp.completions) == 16
            for text, answer, reward in zip(exp.completions, exp.answers, exp.rewards):
                assert rewards.digits_reward(text, answer) == reward
            recomputed, sampled, mask = recomputed_logp(
                policy.config, policy.frozen, exp.rollout, cfg.rollout.temperature, lora.lora_scale(cfg.lora)
            )
            gap = np.abs(recomputed - sampled)[mask > 0]
            assert gap.max() < 5e-3, gap.max()  # bf16 cache: ~6e-4; a token or log-prob out of place: ~1
        handed = PromptLoader(dataset, cfg.rollout.prompts_per_step, seed=0)
        handed = [p for _ in range(batches) for p in next(handed)["prompt"]]
        assert sorted(handed) == sorted(trained + [c.prompt for c in carry])  # none lost, none twice
        assert unstarted_ever > 0 and any(c.since is None for c in carry), [c.since for c in carry]
        state, saved = loader.state(), json.loads(json.dumps(partial_rollouts.to_meta(carry)))
        assert partial_rollouts.from_meta(saved) == carry
        runs = []
        for resumed in (carry, partial_rollouts.from_meta(saved)):
            loader.restore(state)
            runs.append(partial_rollouts.collect_partial(
                cfg, policy, policy.frozen, loader, pool, jax.random.fold_in(key, 3), resumed, 3, max_batch=6
            ))  # fmt: skip
    (a, stats_a, carry_a), (b, stats_b, carry_b) = runs
    np.testing.assert_array_equal(np.asarray(a.rollout.tokens), np.asarray(b.rollout.tokens))
    np.testing.assert_array_equal(np.asarray(a.rollout.logprobs), np.asarray(b.rollout.logprobs))
    assert partial_rollouts.to_meta(carry_a) == partial_rollouts.to_meta(carry_b)
    assert {k: v for k, v in stats_a.items() if not k.startswith("time/") and "per_s" not in k} == {
        k: v for k, v in stats_b.items() if not k.startswith("time/") and "per_s" not in k
    }


def test_a_killed_and_resumed_partial_run_equals_an_uninterrupted_one(tmp_path, tiny_model_dir, monkeypatch):
    """K = 1, 4 steps: stopped after step 2 (its checkpoint holds the paused groups) and resumed, the run
    logs the scalars (off-policy share, staleness, carried groups included) and trains the LoRA of one
    that ran straight through."""
    from test_train import DIGIT_REWARD, _assert_same_run, _config, _scalars_without_timing

    from qerl_jax import train

    monkeypatch.setattr(experience, "sampling_config", _stopping_sampling)
    monkeypatch.setattr(sampler, "MONITOR_STEPS", 4)
    run = {"train.total_steps": 4, "train.checkpoint_every": 2, "rl.reward": DIGIT_REWARD,
           "rollout.max_staleness": 1, "rollout.max_batch": 6}  # fmt: skip
    straight = _config(tmp_path / "straight", tiny_model_dir, **run)
    train.train(straight)
    train.train(_config(tmp_path / "resumed", tiny_model_dir, **run, **{"train.stop_after_steps": 2}))
    resumed = _config(tmp_path / "resumed", tiny_model_dir, **run, **{"resume": True})
    train.train(resumed)
    _assert_same_run(straight, resumed)
    scalars = _scalars_without_timing(str(tmp_path / "straight" / "tensorboard"))
    assert max(v for _, v in scalars["rollout/carried_groups"]) > 0
    assert max(v for _, v in scalars["rollout/offpolicy_tokens_frac"]) > 0


def test_the_partial_tracker_keeps_at_most_twice_its_share_in_flight_beside_the_groups_it_dropped():
    """T = 1.5 x the groups expected to be needed, at most 2 x want; the started carried groups are always
    admitted. Dynamic sampling at a low keep rate raises the limit while too few groups vary, but never
    past 2 x want plus the complete groups of equal rewards: at most `want` started groups are carried."""
    import concurrent.futures

    assert partial_rollouts.in_flight(32, 1.0, dynamic=False) == 48
    assert partial_rollouts.in_flight(32, 1.0, dynamic=True) == math.ceil(39 * 1.5)  # groups_to_admit: 39
    assert partial_rollouts.in_flight(32, 0.75, dynamic=True) == 64  # 1.5 x 52 = 78, capped
    rewards_N = np.zeros((40,), np.float32)
    rewards_N[5] = 1.0  # group 2 (rows 4, 5) varies; groups 0 and 1 do not

    def submit(seqs, tokens, lengths):
        future = concurrent.futures.Future()
        future.set_result((rewards_N[seqs], rewards_N[None, seqs]))
        return future

    def tracker(started, dynamic=True):
        return partial_rollouts.PartialTracker(20, 2, 2, submit, dynamic=dynamic, keep_rate=0.2,
                                               in_flight=partial_rollouts.in_flight(2, 0.2, dynamic), started=started,
                                               must_G=np.zeros((20,), bool))  # fmt: skip

    t = tracker(started=1)
    assert t.limit == 4  # 1.5 x groups_to_admit(2, 0.2) = 18, capped at 2 x 2
    assert t.bounds(False) == (8, 40)  # nothing decided: the keep rate's estimate wants more, the cap says no
    t.finished(np.arange(6), np.zeros((6, 1), np.int32), np.ones((6,), np.int32))
    assert t.bounds(False) == (12, 40)  # 2 dropped: 2 x 2 + 2 groups
    assert not t.done() and t.usable().sum() == 1
    assert tracker(started=7).bounds(False) == (14, 40)  # the carried started groups all resume
    assert tracker(started=1, dynamic=False).bounds(False) == (6, 40)  # 1.5 x 2


def test_a_partial_call_plans_its_rows_for_few_shapes_as_the_keep_rate_moves():
    """The rows are planned for the groups in flight rounded up to a multiple of want / 2: at the keep
    rates of a real run T is 59, 62, 63 or 64 groups of 8 for 32 wanted, all planned as 512 rows (each
    distinct row count compiles the call's programs)."""
    planned = set()
    for keep_rate in (1.0, 0.95, 0.92, 0.8, 0.6):
        in_flight = partial_rollouts.in_flight(32, keep_rate, dynamic=True)
        t = partial_rollouts.PartialTracker(100, 8, 32, None, dynamic=True, keep_rate=keep_rate, in_flight=in_flight,
                                            started=0, must_G=np.zeros((100,), bool))  # fmt: skip
        planned.add(t.planned_seqs())
    assert {partial_rollouts.in_flight(32, k, dynamic=True) for k in (1.0, 0.95, 0.92, 0.8)} == {59, 62, 63, 64}
    assert planned == {512}
    t = partial_rollouts.PartialTracker(40, 8, 32, None, dynamic=False, keep_rate=1.0, in_flight=33, started=0,
                                        must_G=np.zeros((40,), bool))  # fmt: skip
    assert t.planned_seqs() == 48 * 8  # 33 rounded up to a multiple of 16


def test_partial_steps_with_dynamic_sampling_keep_only_varied_complete_groups(tmp_path, tiny_model_dir, monkeypatch):
    """K = 2 with DAPO's dynamic sampling: each step keeps 4 complete groups with varied rewards, carries
    no complete group of equal rewards, no group longer than K steps, and no more started groups than
    the next step trains."""
    from worker_rewards import hashed_reward

    monkeypatch.setattr(experience, "sampling_config", _stopping_sampling)
    monkeypatch.setattr(sampler, "MONITOR_STEPS", 4)
    cfg = _tiny_run(tmp_path, tiny_model_dir, **{
        "rollout.max_staleness": 2, "rollout.max_batch": 6, "rl.dynamic_sampling": True,
        "rl.reward": "worker_rewards:hashed_reward",
    })  # fmt: skip
    policy = load_policy(cfg)
    loader = PromptLoader(load_math_dataset(cfg.data.train), cfg.rollout.prompts_per_step, seed=0)
    carry, keep_rate, carried_ever = [], 1.0, 0
    with reward_pool.RewardPool(1) as pool:
        for step in range(3):
            exp, stats, carry = partial_rollouts.collect_partial(
                cfg, policy, policy.frozen, loader, pool, jax.random.key(step), carry, step, keep_rate, max_batch=6
            )
            keep_rate, carried_ever = stats["rollout/keep_rate"], carried_ever + len(carry)
            assert exp.groups_kept == 4 and stats["rollout/staleness_max"] <= 2
            # in flight: at most 2 * 4 groups beside those dropped, so at most 4 started ones carried
            assert stats["rollout/carried_groups"] == sum(c.since is not None for c in carry) <= 4
            groups = exp.rewards.reshape(4, -1)
            assert all(len(set(g.tolist())) > 1 for g in groups)
            for text, answer, reward in zip(exp.completions, exp.answers, exp.rewards):
                assert hashed_reward(text, answer) == reward
            for c in carry:  # none past K; a complete one carried (surplus) has varied rewards
                assert c.since is None or step - c.since < 2
                if all(c.finished):
                    texts = policy.tokenizer.batch_decode(c.tokens, skip_special_tokens=True)
                    assert len({hashed_reward(t, c.answer) for t in texts}) > 1
    assert carried_ever > 0


# ----------------------------------------------------------------------------- on a data-parallel mesh

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from conftest import REPO, two_device_env  # noqa: E402


def _two_shard_steps(workdir: str, model_dir: str, steps: int = 4, cut: int = 2) -> dict:
    """K = 1, `steps` steps on a ("data", "model") = (2, 1) mesh (run in a process of 2 CPU devices, below):
    straight through, then again, stopped after step `cut` and continued from its carry's JSON and loader
    state. Asserts as it goes; returns what the test checks of it."""
    from qerl_jax import sharding
    from qerl_jax.rollout import data_parallel

    experience.sampling_config, sampler.MONITOR_STEPS = _stopping_sampling, 4
    cfg = _tiny_run(workdir, model_dir, **{"rollout.max_staleness": 1, "rollout.max_batch": 6})
    policy, mesh = load_policy(cfg), sharding.make_mesh(2, 1)
    calls, generate_dp = [], data_parallel.generate_data_parallel

    def recorded(*args, **kw):  # each call's per-shard prompts, carried samples and trackers
        calls.append(kw)
        return generate_dp(*args, **kw)

    data_parallel.generate_data_parallel = recorded
    fresh_loader = lambda: PromptLoader(load_math_dataset(cfg.data.train), 4, seed=0)  # noqa: E731

    def run(pool, resume_at=None):
        loader, carry, out, trained = fresh_loader(), [], [], []
        for step in range(steps):
            if step == resume_at:  # a checkpoint's loader state and carry, on the same layout
                state, meta = loader.state(), json.loads(json.dumps(partial_rollouts.to_meta(carry)))
                loader, carry = fresh_loader(), partial_rollouts.deal(partial_rollouts.from_meta(meta), 2, 2)
                loader.restore(state)
            before = carry
            exp, stats, carry = partial_rollouts.collect_partial(
                cfg, policy, policy.frozen, loader, pool, jax.random.key(10 + step), carry, step, mesh=mesh,
                max_batch=6,
            )  # fmt: skip
            call = calls[-1]
            for d in (0, 1):  # a shard's carried groups resume first in its own call, with their samples
                mine = [i for i, c in enumerate(before) if c.shard == d]
                assert call["plan"].prompts[d][: len(mine)].tolist() == mine
                held = [(j * 4 + s, t) for j, i in enumerate(mine) for s, t in enumerate(before[i].tokens) if t]
                partial = call["plan"].parts[d].partial
                assert partial.seqs_K.tolist() == [r for r, _ in held]
                assert all((partial.tokens_KxM[k, : len(t)] == t).all() for k, (_, t) in enumerate(held))
                tracker = call["plan"].parts[d].monitor  # each shard ended on its own share: 2 complete groups of its own
                assert tracker.want == 2 and tracker.done() and tracker.complete().sum() >= 2
            forced = [c for c in before if c.since is not None]  # K = 1: every started carried group
            assert exp.groups_kept == 4 and stats["rollout/forced_groups"] == len(forced)
            assert all(c.since == step for c in carry if c.since is not None)  # ... finished in the next step
            for d in (0, 1):  # each shard kept at most 3 in flight, its share 2: it carries at most 1 started
                assert sum(c.since is not None for c in carry if c.shard == d) <= 1
            trained += exp.prompts[::4]
            for c in forced:  # ... and was trained with the tokens and sampler log-probs it was carried with
                rows = [r for r, p in enumerate(exp.prompts) if p == c.prompt]
                assert len(rows) == 4
                for r, t, lp in zip(rows, c.tokens, c.logprobs):
                    np.testing.assert_array_equal(np.asarray(exp.rollout.tokens)[r, : len(t)], t)
                    np.testing.assert_array_equal(np.asarray(exp.rollout.logprobs)[r, : len(t)], np.float32(lp))
            scalars = {k: v for k, v in stats.items() if not k.startswith("time/") and "per_s" not in k}
            out.append((np.asarray(exp.rollout.tokens), np.asarray(exp.rollout.logprobs), scalars,
                        partial_rollouts.to_meta(carry)))  # fmt: skip
        handed = fresh_loader()  # no prompt the loader handed out is lost: trained or carried
        handed = [p for _ in range(loader.state()["step"]) for p in next(handed)["prompt"]]
        assert sorted(handed) == sorted(trained + [c.prompt for c in carry])
        return out, exp

    with reward_pool.RewardPool(1) as pool:
        straight, exp = run(pool)
        resumed, _ = run(pool, resume_at=cut)  # its first steps: the straight run's again
    for (tokens, logp, scalars, carry), (tokens_b, logp_b, scalars_b, carry_b) in zip(straight, resumed):
        np.testing.assert_array_equal(tokens, tokens_b)
        np.testing.assert_array_equal(logp, logp_b)
        assert scalars == scalars_b and carry == carry_b
    recomputed, sampled, mask = recomputed_logp(
        policy.config, policy.frozen, exp.rollout, cfg.rollout.temperature, lora.lora_scale(cfg.lora)
    )
    return {
        "logp_gap": float(np.abs(recomputed - sampled)[mask > 0].max()),
        "carried_shards": sorted({c["shard"] for _, _, _, carry in straight for c in carry}),
        "carried": [len(carry) for _, _, _, carry in straight],
        "unstarted": [sum(c["since"] is None for c in carry) for _, _, _, carry in straight],
        "offpolicy": [s["rollout/offpolicy_tokens_frac"] for _, _, s, _ in straight],
    }


def test_two_data_shards_each_carry_their_own_groups_deterministically_and_resume_exactly(tmp_path, tiny_model_dir):
    """K = 1 on 2 (CPU) data shards, 4 steps: each shard resumes the groups it paused, first in its own
    call, admits its block of each batch and ends on its own 2 complete groups; every carried group's
    tokens and sampler log-probs are trained as carried (and belong to its prompt: recomputed); run again
    and continued from a JSON carry after step 2, the run is the same (kept rows, scalars, carry)."""
    script = (
        "import json, sys, test_partial_rollouts as t; "
        "print('RESULT', json.dumps(t._two_shard_steps(sys.argv[1], sys.argv[2])))"
    )
    env = two_device_env(PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path), tiny_model_dir], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result["carried_shards"] == [0, 1], result  # both shards paused groups
    assert all(n > 0 for n in result["carried"][:-1]), result
    assert result["unstarted"][1] > 0, result  # the JSON carry the resumed run continues from holds unstarted groups
    assert max(result["offpolicy"][1:]) > 0.0, result
    assert result["logp_gap"] < 5e-3, result  # a token or log-prob put in another row: ~1


def test_a_carry_resumed_on_another_number_of_data_shards_is_dealt_round_robin(capsys):
    """Same layout: each group stays on its shard; another: group i goes to shard i % shards, and the run
    says so; collect_partial refuses a group of a shard the mesh lacks (before any work)."""
    from qerl_jax import train

    groups = [partial_rollouts.CarriedGroup("p", "a", {}, [1], 0, [[]], [[]], [False], [False], shard=d)
              for d in (1, 0, 1, 1, 0)]  # fmt: skip
    assert partial_rollouts.deal(groups, 2, 2) == groups
    assert [c.shard for c in partial_rollouts.deal(groups, 2, 3)] == [0, 1, 2, 0, 1]
    assert [c.shard for c in partial_rollouts.deal(groups, 2, 1)] == [0] * 5
    cfg = run_config.from_config_dict(set_fields(load_config("tiny"), {"rollout.max_staleness": 1}))
    meta = {"carry": partial_rollouts.to_meta(groups), "carry_shards": 2}
    assert [c.shard for c in train._resumed_carry(meta, cfg, None)] == [0] * 5
    assert "the 5 groups the checkpoint paused on 2 data shards are dealt round-robin over 1" in capsys.readouterr().out
    old = [{k: v for k, v in c.items() if k != "shard"} for c in meta["carry"]]  # written before carries had shards
    assert train._resumed_carry({"carry": old}, cfg, None) == partial_rollouts.deal(groups, 2, 1)
    with pytest.raises(ValueError, match=r"carried groups of data shards \[0, 1\] on a mesh of 1"):
        partial_rollouts.collect_partial(cfg, None, None, None, None, None, groups, 1, max_batch=None)
