"""experience.py: one step's rollouts, rewards and kept groups; DAPO's refills in one rollout call
equal refill rounds (one rollout per loader batch) on the same samples."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import load_config, set_fields
from rollout_helpers import assert_same_samples
from worker_rewards import digit_reward, hashed_reward

from qerl_jax import experience, lora, reward_pool, run_config, train
from qerl_jax.data import PromptLoader, load_math_dataset, tokenize_prompts
from qerl_jax.policy import load_policy
from qerl_jax.rl import losses
from qerl_jax.rollout import batch as rollout_batch
from qerl_jax.rollout.sampler import RolloutOptions, RolloutPart, generate

DIGIT_REWARD = "worker_rewards:digit_reward"
HASHED_REWARD = "worker_rewards:hashed_reward"


def _run(workdir, model_dir, **overrides) -> run_config.RunConfig:
    cfg = load_config("tiny")
    cfg.workdir, cfg.model.tiny, cfg.model.path, cfg.eval.num_examples = str(workdir), False, model_dir, 0
    return run_config.from_config_dict(set_fields(cfg, overrides))


@pytest.fixture(scope="module")
def pool():
    with reward_pool.RewardPool(2) as p:
        yield p


def _refill_rounds(cfg, policy, loader, key, reward_fn):
    """The reference: one `generate` call per loader batch, scored after it, until enough groups
    vary (each sample on the stream collect_experience gives it)."""
    g, want = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    kept, rewards_kept = [], []
    for b in range(1 + cfg.rl.max_refill_rounds):
        rows = next(loader)
        tok = tokenize_prompts(policy.tokenizer, rows["prompt"], cfg.data.max_prompt_len, cfg.data.template,
                               system_prompt=cfg.data.system_prompt)  # fmt: skip
        streams = ((b * want + np.asarray(tok.kept_indices))[:, None] * g + np.arange(g)).reshape(-1)
        batch = generate(
            policy.config, policy.frozen, tok.input_ids, tok.attention_mask, jax.random.fold_in(key, 0),
            run_config.sampling_config(cfg, policy), group_size=g, lora_scale=lora.lora_scale(cfg.lora),
            part=RolloutPart(streams=streams),
            options=RolloutOptions(backend=policy.backend, min_prompt_len=cfg.data.max_prompt_len),
        )  # fmt: skip
        lengths, tokens = np.asarray(batch.lengths), np.asarray(batch.tokens)
        texts = policy.tokenizer.batch_decode([t[:n] for t, n in zip(tokens, lengths)], skip_special_tokens=True)
        shaped = np.asarray([reward_fn(t, "") for t in texts], np.float32)
        varied = np.flatnonzero(np.asarray(losses.dynamic_sampling_mask(shaped, g)))[: want - sum(k.tokens.shape[0] for k in kept) // g]
        rows_kept = (varied[:, None] * g + np.arange(g)).reshape(-1)
        kept.append(rollout_batch.select_rows(batch, rows_kept))
        rewards_kept.append(shaped[rows_kept])
        if sum(k.tokens.shape[0] for k in kept) >= want * g:
            break
    return rollout_batch.concat(kept), np.concatenate(rewards_kept), b + 1


@pytest.mark.parametrize("keep_rate, max_batch", [(1.0, 0), (0.3, 6)])
def test_one_call_keeps_what_refill_rounds_keep(tmp_path, tiny_model_dir, pool, keep_rate, max_batch):
    """The kept groups, their rewards, advantages and the packed train batch (hence the loss) equal
    those of refill rounds on the same samples, whatever the pacing (keep_rate) and the rows;
    the loader ends where the rounds leave it."""
    cfg = _run(tmp_path, tiny_model_dir, **{
        "rl.reward": HASHED_REWARD, "rl.dynamic_sampling": True, "rl.max_refill_rounds": 4,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 8,
        "rollout.max_batch": max_batch,
    })  # fmt: skip
    policy = load_policy(cfg)
    dataset = load_math_dataset(cfg.data.train)
    key = jax.random.key(3)
    loader, reference = PromptLoader(dataset, 4, seed=1), PromptLoader(dataset, 4, seed=1)
    exp, stats = experience.collect_experience(cfg, policy, policy.frozen, loader, pool, key, keep_rate=keep_rate, max_batch=max_batch or None)
    want_batch, want_rewards, rounds = _refill_rounds(cfg, policy, reference, key, hashed_reward)
    assert rounds > 1, "the case must need a refill round"
    assert stats["rollout/prompt_batches"] == rounds and loader.state() == reference.state()
    assert_same_samples(exp.rollout, want_batch, "one call vs rounds")
    np.testing.assert_array_equal(exp.rollout.prompt_ids, want_batch.prompt_ids)
    np.testing.assert_array_equal(exp.rewards, want_rewards)
    reference_exp = dataclasses.replace(exp, rollout=want_batch, rewards=want_rewards)
    got, want = train.make_train_batch(cfg, exp, cfg.rl.micro_batch_size), train.make_train_batch(cfg, reference_exp, cfg.rl.micro_batch_size)
    for name in want:  # the advantages and everything the loss reads
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)
    assert stats["rollout/groups_kept"] == 4 and stats["rollout/groups_sampled"] <= 4 * rounds
    np.testing.assert_array_equal(exp.rollout.decoded, exp.rollout.lengths)  # kept rows all finished
    assert stats["rollout/decoded_tokens"] >= int(np.sum(exp.rollout.lengths))
    assert 0.0 <= stats["rollout/unused_tokens_frac"] < 1.0
    # every token after a sequence's first (sampled by its admission) took a decode step
    assert int(np.max(exp.rollout.lengths)) - 1 <= stats["rollout/decode_steps"] <= stats["rollout/decoded_tokens"]
    assert 1 <= stats["rollout/decode_segments"] <= stats["rollout/decode_steps"]
    # max_batch 6: a bucket of 8 rows (then the tail's); unbounded: at most every sequence sampled at once
    assert 1 <= stats["rollout/rows_per_decode_step"] <= (8 if max_batch else 4 * 4 * rounds)
    loop_s = stats["time/rollout_loop_host_s"] + stats["time/rollout_loop_device_s"]
    assert 0 < loop_s <= stats["time/rollout_s"]


def test_dynamic_sampling_keeps_only_groups_with_varied_rewards(tmp_path, tiny_model_dir, pool):
    cfg = _run(tmp_path, tiny_model_dir, **{
        "rl.reward": DIGIT_REWARD, "rl.dynamic_sampling": True, "rl.max_refill_rounds": 3,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 8,
    })  # fmt: skip
    policy = load_policy(cfg)
    loader = PromptLoader(load_math_dataset(cfg.data.train), cfg.rollout.prompts_per_step, seed=0)
    exp, stats = experience.collect_experience(cfg, policy, policy.frozen, loader, pool, jax.random.key(0), max_batch=None)
    assert exp is not None and 0 < exp.groups_kept <= 4
    assert stats["rollout/groups_sampled"] >= exp.groups_kept
    groups = exp.rewards.reshape(-1, 4)
    assert len(groups) == exp.groups_kept
    assert all(len(set(g.tolist())) > 1 for g in groups)  # no group with equal rewards survives
    assert exp.rollout.tokens.shape[0] == len(exp.completions) == len(exp.answers) == exp.rewards.shape[0]
    # Rows stay aligned: each kept completion re-scores to its recorded reward.
    for c, a, r in zip(exp.completions, exp.answers, exp.rewards):
        assert digit_reward(c, a) == r
    batch = train.make_train_batch(cfg, exp, cfg.rl.micro_batch_size)
    assert batch["advantages"].shape[0] == 16 and float(np.abs(batch["advantages"][len(exp.completions) :]).sum()) == 0.0
    assert batch["input_ids"].shape[0] % cfg.rl.micro_batch_size == 0 and (batch["token_index"][len(exp.completions) :] == -1).all()


def test_weighted_rewards_per_reward_means_and_reward_scaling(tmp_path, tiny_model_dir):
    cfg = _run(tmp_path, tiny_model_dir, **{
        "rl.reward": f"{DIGIT_REWARD},worker_rewards:prompt_reward", "rl.reward_weights": (1.0, 0.5),
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 8,
    })  # fmt: skip
    policy = load_policy(cfg)
    loader = PromptLoader(load_math_dataset(cfg.data.train), cfg.rollout.prompts_per_step, seed=0)
    with reward_pool.RewardPool(2) as pool:
        exp, stats = experience.collect_experience(cfg, policy, policy.frozen, loader, pool, jax.random.key(0), max_batch=None)
    digits = np.array([digit_reward(c, a) for c, a in zip(exp.completions, exp.answers)])
    prompt = np.array([len(p) / 1000 + 1.0 for p in exp.prompts])
    assert np.ptp(prompt) > 0  # the second reward really varies with the row
    np.testing.assert_allclose(exp.rewards, digits + 0.5 * prompt, rtol=1e-6)
    # Tags keep TensorBoard's characters: "module:function" is logged as "module_function".
    np.testing.assert_allclose(stats["reward/worker_rewards_digit_reward_mean_sampled"], digits.mean(), rtol=1e-5)
    np.testing.assert_allclose(stats["reward/worker_rewards_prompt_reward_mean_sampled"], prompt.mean(), rtol=1e-6)
    for scale in ("group", "batch", "none"):
        cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, scale_rewards=scale))
        got = np.asarray(train.make_train_batch(cfg, exp, cfg.rl.micro_batch_size)["advantages"])[: len(exp.rewards)]
        np.testing.assert_allclose(got, np.asarray(losses.group_advantages(exp.rewards, 4, scale=scale)), rtol=1e-6)
    g = exp.rewards.reshape(-1, 4)
    np.testing.assert_allclose(got, (g - g.mean(1, keepdims=True)).reshape(-1), atol=1e-6)  # "none"


def test_shard_order_takes_each_shards_block_of_every_batch():
    order = experience.shard_order(np.array([0, 0, 0, 0, 1, 1, 1, 1]), 2)
    assert [o.tolist() for o in order] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_each_shard_keeps_its_first_varied_groups_and_the_loader_gives_back_the_rest():
    g, nan = 2, np.nan
    batch_of = np.repeat([0, 1, 2], 4)  # 3 batches of 4 prompts
    order = experience.shard_order(batch_of, 2)  # shard 0: 0 1 4 5 8 9; shard 1: 2 3 6 7 10 11
    varied, equal = [0.0, 1.0], [1.0, 1.0]
    per_prompt = {0: equal, 1: varied, 2: varied, 3: varied, 4: equal, 5: varied, 6: [1.0, nan], 7: [nan, nan]}
    shaped = np.full(12 * g, np.nan, np.float32)
    for p, r in per_prompt.items():
        shaped[p * g : p * g + g] = r
    kept, sampled, used = experience.select_groups(shaped, order, [2, 2], g, True, batch_of)
    assert kept.tolist() == [1, 2, 3, 5]  # shard 0: 1, 5 (0 and 4 equal); shard 1: 2, 3 (6, 7 not needed)
    assert sorted(sampled.tolist()) == [0, 1, 2, 3, 4, 5] and used == 2  # shard 0 reached batch 1
    kept, sampled, used = experience.select_groups(shaped, order, [2, 2], g, False, batch_of)
    assert kept.tolist() == [0, 1, 2, 3] and used == 1
    kept, _, used = experience.select_groups(shaped, order, [4, 4], g, True, batch_of)  # too few vary
    assert kept.tolist() == [1, 2, 3, 5] and used == 3
