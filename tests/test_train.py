"""The training command end to end on the tiny config: logs, checkpoints, export, exact resume, learning."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from conftest import load_config

import qerl_jax
from qerl_jax import train
from qerl_jax.checkpoint import Checkpointer
from qerl_jax.metrics import read_scalars
from qerl_jax.policy import UserFacingError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED_SCALARS = [
    "reward/mean",
    "reward/std",
    "reward/accuracy",
    "rollout/response_length_mean",
    "train/entropy",
    "train/approx_kl",
    "train/clip_frac",
    "aqn/sigma",
    "optim/lr",
    "rollout/tokens_per_s",
    "train/tokens_per_s",
    "time/rollout_s",
    "time/reward_s",
    "time/train_s",
]


def digit_reward(completion: str, ground_truth: str) -> float:
    """A reward learnable from scratch: the share of digit characters (up to 8) in the completion."""
    del ground_truth
    return min(sum(ch.isdigit() for ch in completion), 8) / 8.0


DIGIT_REWARD = "test_train:digit_reward"  # imported by name in the reward workers


def _config(workdir, model_dir, **overrides):
    cfg = load_config("tiny")
    cfg.workdir = str(workdir)
    cfg.model.tiny = False
    cfg.model.path = model_dir
    cfg.eval.num_examples = 0
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def _scalars_without_timing(logdir):
    scalars = read_scalars(logdir)
    return {
        k: v
        for k, v in scalars.items()
        if not (k.startswith("time/") or k.endswith("tokens_per_s") or k.startswith("memory/"))
    }


def test_tiny_run_logs_checkpoints_and_exports_peft(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import Qwen2ForCausalLM

    cfg = _config(
        tmp_path / "run",
        tiny_model_dir,
        **{"train.total_steps": 3, "train.checkpoint_every": 2, "eval.num_examples": 4, "rl.reward": DIGIT_REWARD},
    )
    train.train(cfg)
    scalars = read_scalars(os.path.join(cfg.workdir, "tensorboard"))
    missing = [k for k in REQUIRED_SCALARS if k not in scalars]
    assert not missing, missing
    assert [s for s, _ in scalars["reward/mean"]] == [0, 1, 2]
    assert any(k.startswith("eval/") for k in scalars)
    assert Checkpointer(os.path.join(cfg.workdir, "checkpoints")).latest_step() == 3
    assert os.path.isfile(os.path.join(cfg.workdir, "eval", "step_3", "summary.json"))

    # The exported adapter on the original (unquantized) base under transformers + peft
    # equals our forward with the trained LoRA on the same base.
    adapter_dir = os.path.join(cfg.workdir, "adapter")
    from qerl_jax.peft_adapter import load_peft_adapter

    config, params = qerl_jax.load_model(tiny_model_dir, dtype="float32")
    trained, adapter_cfg = load_peft_adapter(adapter_dir, config.num_hidden_layers)
    assert np.abs(trained["layers"]["q_proj"]["b"]).max() > 0  # training moved B off zero
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12)).astype(np.int32)
    scale = adapter_cfg["lora_alpha"] / adapter_cfg["r"]
    ours = np.asarray(qerl_jax.forward(config, {**params, "lora": trained}, ids, lora_scale=scale))
    hf = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        ref = peft_model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max())


def test_kill_and_resume_reproduces_uninterrupted_run(tmp_path, tiny_model_dir):
    common = {"train.total_steps": 4, "train.checkpoint_every": 2, "rl.reward": DIGIT_REWARD}
    straight = _config(tmp_path / "straight", tiny_model_dir, **common)
    train.train(straight)

    interrupted = _config(tmp_path / "resumed", tiny_model_dir, **common, **{"train.stop_after_steps": 2})
    train.train(interrupted)
    assert Checkpointer(os.path.join(interrupted.workdir, "checkpoints")).latest_step() == 2
    assert not os.path.exists(os.path.join(interrupted.workdir, "adapter"))  # not finished yet
    resumed = _config(tmp_path / "resumed", tiny_model_dir, **common, **{"resume": True})
    train.train(resumed)

    like = None
    states = []
    for cfg in (straight, resumed):
        ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"))
        assert ckpt.latest_step() == 4
        if like is None:
            like = _train_state_like(cfg)
        states.append(ckpt.restore(4, like=like)[0])
    for a, b in zip(jax.tree.leaves(states[0].lora), jax.tree.leaves(states[1].lora)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    m_straight = _scalars_without_timing(os.path.join(straight.workdir, "tensorboard"))
    m_resumed = _scalars_without_timing(os.path.join(resumed.workdir, "tensorboard"))
    assert set(m_straight) == set(m_resumed)
    for tag, values in m_straight.items():
        assert dict(values) == dict(m_resumed[tag]), tag


def _train_state_like(cfg):
    from qerl_jax import lora
    from qerl_jax.policy import load_policy, lora_config, optimizer_from_config
    from qerl_jax.rl.step import init_train_state

    policy = load_policy(cfg)
    optimizer, _ = optimizer_from_config(cfg)
    return init_train_state(lora.init_lora(jax.random.key(0), policy.config, lora_config(cfg)), optimizer)


def test_grpo_loop_learns_a_reward_from_scratch(tmp_path, tiny_model_dir):
    cfg = _config(
        tmp_path / "learn",
        tiny_model_dir,
        **{
            "train.total_steps": 30,
            "train.checkpoint_every": 100,
            "train.sample_every": 0,
            "rl.reward": DIGIT_REWARD,
            "rl.loss": "grpo",
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 8,
            "rollout.max_new_tokens": 16,
            # The tiny model's lm_head (std 0.02) bounds how far LoRA can move the logits;
            # a low temperature lets that move show in the samples.
            "rollout.temperature": 0.3,
            "optim.lr": 1e-2,
            "optim.warmup_frac": 0.0,
            "optim.schedule": "constant",
            "optim.clip_norm": 1.0,
            "optim.weight_decay": 0.0,
            "rl.micro_batch_size": 32,
        },
    )
    train.train(cfg)
    rewards = [v for _, v in sorted(read_scalars(os.path.join(cfg.workdir, "tensorboard"))["reward/mean"])]
    start, end = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert end > start + 0.1 and end > 2.5 * start, (start, end, rewards)


def test_missing_model_path_is_a_clear_error(tmp_path):
    cfg = _config(tmp_path, str(tmp_path / "no_such_model"))
    with pytest.raises(UserFacingError, match="does not exist.*--config.model.path"):
        train.train(cfg)


def test_rollout_batch_smaller_than_a_group_is_refused_before_loading(tmp_path):
    cfg = _config(tmp_path, str(tmp_path / "no_such_model"), **{"rollout.max_batch": 3, "rollout.group_size": 4})
    with pytest.raises(
        UserFacingError, match=r"rollout\.max_batch=3 is smaller than one group \(rollout\.group_size=4\)"
    ):
        train.train(cfg)


def test_command_line_reports_errors_without_traceback(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={tmp_path}"]
    out = subprocess.run(
        base + ["--config.model.tiny=False", "--config.model.path=/nonexistent"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert "error: model path '/nonexistent' does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run(
        base + ["--config.rl.grup_size=3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0
    assert "grup_size" in out.stderr


def test_eval_of_run_checkpoint_equals_eval_of_exported_adapter(tmp_path, tiny_model_dir):
    import json

    from qerl_jax import evaluation

    cfg = _config(tmp_path / "run", tiny_model_dir, **{"train.total_steps": 2, "rl.reward": DIGIT_REWARD})
    train.train(cfg)
    outputs = []
    for checkpoint in (cfg.workdir, os.path.join(cfg.workdir, "adapter")):
        cfg.eval.checkpoint, cfg.eval.num_examples, cfg.eval.max_new_tokens = checkpoint, 4, 8
        cfg.eval.output_dir = str(tmp_path / f"eval_{len(outputs)}")
        evaluation.evaluate(cfg)
        outputs.append(
            [json.loads(l)["completion"] for l in open(os.path.join(cfg.eval.output_dir, "gsm8k_test.jsonl"))]
        )
    assert outputs[0] == outputs[1]


def test_dynamic_sampling_keeps_only_groups_with_varied_rewards(tmp_path, tiny_model_dir):
    from qerl_jax import rewards
    from qerl_jax.data import PromptLoader, load_math_dataset
    from qerl_jax.policy import load_policy

    cfg = _config(
        tmp_path,
        tiny_model_dir,
        **{
            "rl.reward": DIGIT_REWARD,
            "rl.dynamic_sampling": True,
            "rl.max_refill_rounds": 3,
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "rollout.max_new_tokens": 8,
        },
    )
    policy = load_policy(cfg)
    loader = PromptLoader(load_math_dataset(cfg.data.train), cfg.rollout.prompts_per_step, seed=0)
    with rewards.RewardPool() as pool:
        exp, stats = train.collect_experience(cfg, policy, policy.frozen, loader, pool, jax.random.key(0))
    assert exp is not None and 0 < exp.groups_kept <= 4
    assert stats["rollout/groups_sampled"] >= exp.groups_kept
    groups = exp.rewards.reshape(-1, 4)
    assert len(groups) == exp.groups_kept
    assert all(len(set(g.tolist())) > 1 for g in groups)  # no group with equal rewards survives
    assert exp.rollout.tokens.shape[0] == len(exp.completions) == len(exp.answers) == exp.rewards.shape[0]
    # Rows stay aligned: each kept completion re-scores to its recorded reward.
    for c, a, r in zip(exp.completions, exp.answers, exp.rewards):
        assert digit_reward(c, a) == r
    batch = train.make_train_batch(cfg, exp)
    assert batch["input_ids"].shape[0] == 16 and float(np.abs(batch["advantages"][len(exp.completions) :]).sum()) == 0.0


def test_data_parallel_run_on_two_devices_matches_one_device(tmp_path):
    """`--config.mesh.data=2` on 2 (CPU) devices: rollouts and train batches split over the data
    axis give the metrics of the 1-device run; a micro-batch that does not split is refused."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    metrics = {}
    for name, extra in (("one", []), ("dp", ["--config.mesh.data=2"])):
        workdir = tmp_path / name
        cmd = [
            sys.executable,
            "-m",
            "qerl_jax.main",
            "--config=configs/tiny.py",
            f"--config.workdir={workdir}",
            "--config.train.total_steps=2",
            "--config.eval.num_examples=0",
            *extra,
        ]
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() == 2
        metrics[name] = read_scalars(os.path.join(workdir, "tensorboard"))
    assert "mesh {'data': 2, 'model': 1}" in out.stdout + out.stderr
    for tag in ("train/entropy", "train/grad_norm", "rollout/response_length_mean"):
        one, dp = np.array(metrics["one"][tag])[:, 1], np.array(metrics["dp"][tag])[:, 1]
        assert one.shape == (2,) and np.all(np.isfinite(one)), tag
        np.testing.assert_allclose(dp, one, rtol=2e-3, err_msg=tag)
    bad = subprocess.run(
        [*cmd[:-1], "--config.mesh.data=2", "--config.rl.micro_batch_size=3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 1 and "must be a multiple of mesh.data" in bad.stderr
