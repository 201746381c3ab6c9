"""The training command end to end on the tiny config: logs, checkpoints, export, exact resume (also
after a kill inside a save and over a corrupted checkpoint), faults (disk full, reward workers killed
or hanging, a reward failing on every completion, non-finite steps), learning."""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from conftest import TWO_DEVICE_RUN_FLAGS, faulty_json_save, load_config, once_per_test_run, set_fields, two_device_env

import qerl_jax
from qerl_jax import run_config, train
from qerl_jax.checkpoint import Checkpointer
from qerl_jax.errors import UserFacingError
from qerl_jax.metrics import read_jsonl_scalars, read_scalars

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
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
    "reward/mean_sampled",
    "reward/accuracy_sampled",
    "rollout/entropy_mc",
    "train/sampler_clip_frac",
    "train/sampler_abs_log_ratio",
]


DIGIT_REWARD = "worker_rewards:digit_reward"  # imported by name in the reward workers


def _config(workdir, model_dir, **overrides):
    cfg = load_config("tiny")
    cfg.workdir = str(workdir)
    cfg.model.tiny = False
    cfg.model.path = model_dir
    cfg.eval.num_examples = 0
    return set_fields(cfg, overrides)


def _run(workdir, model_dir, **overrides) -> run_config.RunConfig:
    """The typed tree of `_config(...)` (for the loop's pieces, which take it)."""
    return run_config.from_config_dict(_config(workdir, model_dir, **overrides))


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
    jsonl = read_jsonl_scalars(os.path.join(cfg.workdir, "tensorboard"))  # the JSON-lines copy
    assert set(jsonl) == set(scalars)
    for tag, values in scalars.items():
        np.testing.assert_allclose(np.array(jsonl[tag]), np.array(values), rtol=1e-6, err_msg=tag)
    # tiny.py's sampler at step 0 (AQN stage 0 is noise-free) is the train forward up to the bf16 KV cache
    assert scalars["train/sampler_abs_log_ratio"][0][1] < 0.05
    # no dynamic sampling in tiny.py: the sampled-row reward is the kept-row one
    assert scalars["reward/mean_sampled"] == scalars["reward/mean"]
    assert any(k.startswith("eval/") for k in scalars)
    assert Checkpointer(os.path.join(cfg.workdir, "checkpoints")).latest_step() == 3
    assert os.path.isfile(os.path.join(cfg.workdir, "eval", "step_3", "summary.json"))

    # The exported adapter on the original (unquantized) base under transformers + peft
    # equals our forward with the trained LoRA on the same base.
    adapter_dir = os.path.join(cfg.workdir, "adapter")
    from qerl_jax.model_io.peft_adapter import load_peft_adapter

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


RESUME_RUN = {"train.total_steps": 4, "train.checkpoint_every": 2, "rl.reward": DIGIT_REWARD}


@pytest.fixture(scope="module")
def straight_run(tiny_model_dir):
    """A 4-step run without interruption: what every resumed run must reproduce (once in the test run,
    whichever worker its tests go to: `once_per_test_run`)."""

    def run(directory):
        train.train(_config(os.path.join(directory, "run"), tiny_model_dir, **RESUME_RUN))
        return os.path.join(directory, "run")

    return _config(once_per_test_run("straight_run", run), tiny_model_dir, **RESUME_RUN)


def _assert_same_run(reference, other):
    """Same LoRA in the step-4 checkpoint and the same scalars (timings aside) at every step."""
    like = _train_state_like(reference)
    states = []
    for cfg in (reference, other):
        ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"))
        assert ckpt.latest_step() == 4
        states.append(ckpt.restore(4, like=like)[0])
    for a, b in zip(jax.tree.leaves(states[0].lora), jax.tree.leaves(states[1].lora)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    m_ref = _scalars_without_timing(os.path.join(reference.workdir, "tensorboard"))
    m_other = _scalars_without_timing(os.path.join(other.workdir, "tensorboard"))
    assert set(m_ref) == set(m_other)
    for tag, values in m_ref.items():
        assert dict(values) == dict(m_other[tag]), tag


def test_kill_and_resume_reproduces_uninterrupted_run(tmp_path, tiny_model_dir, straight_run):
    interrupted = _config(tmp_path / "resumed", tiny_model_dir, **RESUME_RUN, **{"train.stop_after_steps": 2})
    train.train(interrupted)
    assert Checkpointer(os.path.join(interrupted.workdir, "checkpoints")).latest_step() == 2
    assert not os.path.exists(os.path.join(interrupted.workdir, "adapter"))  # not finished yet
    resumed = _config(tmp_path / "resumed", tiny_model_dir, **RESUME_RUN, **{"resume": True})
    train.train(resumed)
    _assert_same_run(straight_run, resumed)


def test_sigkill_inside_a_save_then_resume_reproduces_uninterrupted_run(tmp_path, tiny_model_dir, straight_run):
    """The process is SIGKILLed while it writes the step-4 checkpoint; --config.resume=True continues
    from the last complete one (step 2) and ends where the uninterrupted run did."""
    workdir = str(tmp_path / "killed")
    script = "\n".join(
        [
            "import orbax.checkpoint as ocp",
            "from conftest import faulty_json_save",
            "import test_train",
            "ocp.handlers.JsonCheckpointHandler.async_save = faulty_json_save(4, 'kill')",
            f"test_train.train.train(test_train._config({workdir!r}, {tiny_model_dir!r}, **test_train.RESUME_RUN))",
        ]
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([REPO, TESTS])}  # conftest, test_train
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    checkpoints = os.path.join(workdir, "checkpoints")
    assert Checkpointer(checkpoints).latest_step() == 2
    assert any(n.startswith("4.") for n in os.listdir(checkpoints))  # the partial save the kill left
    resumed = _config(workdir, tiny_model_dir, **RESUME_RUN, **{"resume": True})
    train.train(resumed)
    _assert_same_run(straight_run, resumed)


def test_resume_skips_a_corrupted_newest_checkpoint_and_refuses_when_none_reads(
    tmp_path, tiny_model_dir, straight_run, capsys
):
    workdir = str(tmp_path / "corrupted")
    shutil.copytree(straight_run.workdir, workdir)
    shutil.rmtree(os.path.join(workdir, "adapter"))
    for path in glob.glob(os.path.join(workdir, "checkpoints", "4", "**", "*"), recursive=True):
        if os.path.isfile(path):
            os.truncate(path, os.path.getsize(path) // 2)
    resumed = _config(workdir, tiny_model_dir, **RESUME_RUN, **{"resume": True})
    train.train(resumed)
    out = capsys.readouterr().out
    assert "resume: skipping the unreadable checkpoint step 4: " in out and "resumed from step 2" in out
    _assert_same_run(straight_run, resumed)  # steps 2 and 3 run again, as in the uninterrupted run

    for step in ("2", "4"):
        for path in glob.glob(os.path.join(workdir, "checkpoints", step, "**", "*"), recursive=True):
            if os.path.isfile(path):
                os.truncate(path, 0)
    with pytest.raises(
        UserFacingError, match=r"cannot resume: no checkpoint in .* can be read.*Not starting from scratch"
    ):
        train.train(resumed)
    fresh = _config(workdir, tiny_model_dir, **RESUME_RUN)  # nor without resume: the checkpoints are the run's
    with pytest.raises(UserFacingError, match="resume = False, but workdir .* holds a run's checkpoints"):
        train.train(fresh)


def test_disk_full_during_a_save_stops_with_the_previous_checkpoint_intact(tmp_path, tiny_model_dir, monkeypatch):
    cfg = _config(tmp_path / "full", tiny_model_dir, **RESUME_RUN)
    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", faulty_json_save(4, "disk_full"))
    with pytest.raises(UserFacingError) as e:
        train.train(cfg)
    message = str(e.value)
    assert "could not write checkpoint step 4 to " in message and "No space left on device" in message
    assert "the previous checkpoint (step 2) is intact" in message and "--config.resume=True" in message
    monkeypatch.undo()
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"))
    assert ckpt.latest_step() == 2
    state, meta = ckpt.restore(2, like=_train_state_like(cfg))
    assert meta["step"] == 2 and int(state.step) == 2


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run_keeping_the_last_good_state(
    tmp_path, tiny_model_dir, monkeypatch
):
    cfg = _config(
        tmp_path / "nan",
        tiny_model_dir,
        **{**RESUME_RUN, "train.total_steps": 6, "train.max_nonfinite": 2, "train.sample_every": 0},
    )
    real = train.make_train_batch
    calls = []

    def poisoned(cfg, exp, mb):  # from the third step on, the advantages (hence loss and gradients) are NaN
        batch = real(cfg, exp, mb)
        calls.append(1)
        if len(calls) > 2:
            batch["advantages"] = batch["advantages"] * np.nan
        return batch

    monkeypatch.setattr(train, "make_train_batch", poisoned)
    with pytest.raises(UserFacingError, match=r"2 consecutive train steps had a non-finite loss.*checkpoints/4"):
        train.train(cfg)
    scalars = read_scalars(os.path.join(cfg.workdir, "tensorboard"))
    assert dict(scalars["train/skipped"]) == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}
    assert dict(scalars["train/skipped_total"]) == {0: 0.0, 1: 0.0, 2: 1.0, 3: 2.0}
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"))
    like = _train_state_like(cfg)
    good, _ = ckpt.restore(2, like=like)
    last, meta = ckpt.restore(4, like=like)
    assert meta["step"] == 4 and int(last.step) == 2 and int(last.total_skips) == 2  # 2 updates, 2 skips
    for a, b in zip(jax.tree.leaves((good.lora, good.opt_state)), jax.tree.leaves((last.lora, last.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not os.path.exists(os.path.join(cfg.workdir, "adapter"))


def test_command_line_run_survives_reward_worker_faults_and_ends_with_a_summary(tmp_path, tiny_model_dir):
    """The README's command on the tiny model, with a reward whose worker is SIGKILLed once and hangs
    once: each costs one completion its reward (0, counted in TensorBoard), the pool recovers, the run
    goes on, and it ends by saying what it did and where its outputs are."""
    workdir = tmp_path / "run"
    faults = tmp_path / "faults"
    faults.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": TESTS, "QERL_TEST_FAULT_DIR": str(faults)}
    cmd = [
        sys.executable,
        "-m",
        "qerl_jax.main",
        "--config=configs/tiny.py",
        f"--config.workdir={workdir}",
        "--config.model.tiny=False",
        f"--config.model.path={tiny_model_dir}",
        "--config.train.total_steps=2",
        "--config.eval.num_examples=2",
        "--config.rl.reward=reward_faults:kill_then_hang",
        "--config.rl.reward_timeout_s=5",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(os.listdir(faults)) == ["hang", "kill"]  # both faults happened
    scalars = read_scalars(str(workdir / "tensorboard"))
    assert [s for s, _ in scalars["reward/mean"]] == [0, 1]
    assert sum(v for _, v in scalars["reward/worker_crashes"]) == 1
    assert sum(v for _, v in scalars["reward/worker_timeouts"]) == 1
    summary = out.stdout[out.stdout.index("done: steps 0 -> 2 of 2 in ") :]
    for line in (
        "  last step: reward ",
        "  eval gsm8k_test/pass_at_1: ",
        f"  last checkpoint: {workdir / 'checkpoints' / '2'}",
        f"  adapter (PEFT): {workdir / 'adapter'}",
        f"  TensorBoard: tensorboard --logdir {workdir / 'tensorboard'}",
    ):
        assert line in summary, summary
    assert os.path.isfile(workdir / "adapter" / "adapter_model.safetensors")


def test_a_reward_failing_on_every_completion_stops_the_run_keeping_the_last_checkpoint(tmp_path, tiny_model_dir):
    """The command with a reward that works for step 0, then raises on every completion: step 1 ends
    the run before it trains, with one line naming the reward and its first error, exit status 2, the
    step-1 checkpoint kept and no adapter exported (today: exit 0, every reward 0)."""
    workdir, calls = tmp_path / "run", tmp_path / "calls"
    calls.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": TESTS, "QERL_TEST_FAULT_DIR": str(calls)}
    cmd = [sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={workdir}",
           "--config.model.tiny=False", f"--config.model.path={tiny_model_dir}", "--config.train.total_steps=4",
           "--config.train.checkpoint_every=1", "--config.eval.num_examples=0",
           "--config.rl.reward=worker_rewards:fails_after_one_step"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert line == (
        "error: reward 'worker_rewards:fails_after_one_step' failed on every one of the 16 completions of step 1 "
        "(first error: ConnectionError: the reward service is down); stopped, the last checkpoint (step 1) in "
        f"{workdir / 'checkpoints'} is kept"
    ), line
    assert Checkpointer(str(workdir / "checkpoints")).latest_step() == 1
    assert not os.path.exists(workdir / "adapter")


def test_time_budget_stops_with_a_checkpoint_and_resumes(tmp_path, tiny_model_dir, monkeypatch):
    """Also: the train step's background compile starts once per process that has a step to take,
    and not at all in one resumed after the last step."""
    started = []
    real = train._precompile_in_background
    monkeypatch.setattr(train, "_precompile_in_background", lambda *a: started.append(1) or real(*a))
    common = {"train.total_steps": 2, "train.checkpoint_every": 100, "rl.reward": DIGIT_REWARD}
    cfg = _config(tmp_path / "run", tiny_model_dir, **common, **{"train.stop_after_minutes": 1e-6})
    train.train(cfg)  # the budget is over after the first step
    assert Checkpointer(os.path.join(cfg.workdir, "checkpoints")).latest_step() == 1
    assert not os.path.exists(os.path.join(cfg.workdir, "adapter"))
    cfg = _config(tmp_path / "run", tiny_model_dir, **common, **{"resume": True})
    train.train(cfg)
    assert Checkpointer(os.path.join(cfg.workdir, "checkpoints")).latest_step() == 2
    assert os.path.isdir(os.path.join(cfg.workdir, "adapter"))
    assert [s for s, _ in read_jsonl_scalars(os.path.join(cfg.workdir, "tensorboard"))["reward/mean"]] == [0, 1]
    assert len(started) == 2
    train.train(cfg)  # resumed at the last step: nothing to take
    assert len(started) == 2


def _train_state_like(cfg):
    from qerl_jax import lora
    from qerl_jax.policy import load_policy
    from qerl_jax.rl.step import init_train_state

    run = run_config.from_config_dict(cfg)
    policy = load_policy(run)
    optimizer, _ = run_config.optimizer_from_config(run)
    return init_train_state(lora.init_lora(jax.random.key(0), policy.config, run.lora), optimizer)


def test_grpo_loop_learns_a_reward_from_scratch(tmp_path, tiny_model_dir):
    cfg = _config(
        tmp_path / "learn",
        tiny_model_dir,
        **{
            # 24 steps: the reward's mean over the last 5 is ~0.29 against ~0.05 over the first 5 (over
            # steps 25-29 of 30: ~0.31), far above the bound; each step costs ~1.7 CPU-s.
            "train.total_steps": 24,
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


def test_the_readme_demo_learns_its_task(tmp_path, tiny_model_dir):
    """configs/tiny.py as it is (the README's first command): the gradient is non-zero at every step
    and the reward rises within its 12 steps."""
    cfg = _config(tmp_path / "demo", tiny_model_dir)
    assert cfg.rl.reward == "digits" and cfg.train.total_steps == 12
    train.train(cfg)
    scalars = read_jsonl_scalars(os.path.join(cfg.workdir, "tensorboard"))
    assert all(v > 0 for _, v in scalars["train/grad_norm"]), scalars["train/grad_norm"]
    rewards = [v for _, v in scalars["reward/mean"]]
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.1, rewards


def test_missing_model_path_is_a_clear_error(tmp_path):
    cfg = _config(tmp_path, str(tmp_path / "no_such_model"))
    with pytest.raises(UserFacingError, match="does not exist.*--config.model.path"):
        train.train(cfg)


def test_eval_of_run_checkpoint_equals_eval_of_exported_adapter(tmp_path, tiny_model_dir, straight_run):
    import json

    from qerl_jax import evaluation

    # The finished 4-step run (its checkpoint and its exported adapter), read only: eval writes to tmp_path.
    cfg = _config(straight_run.workdir, tiny_model_dir, **RESUME_RUN)
    outputs = []
    for checkpoint in (cfg.workdir, os.path.join(cfg.workdir, "adapter")):
        cfg.eval.checkpoint, cfg.eval.num_examples, cfg.eval.max_new_tokens = checkpoint, 4, 8
        cfg.eval.output_dir = str(tmp_path / f"eval_{len(outputs)}")
        evaluation.evaluate(cfg)
        outputs.append(
            [json.loads(l)["completion"] for l in open(os.path.join(cfg.eval.output_dir, "gsm8k_test.jsonl"))]
        )
    assert outputs[0] == outputs[1]


def test_data_parallel_run_on_two_devices_matches_one_device(tmp_path, finished_tiny_run, two_device_tiny_run):
    """`--config.mesh.data=2` on 2 (CPU) devices (the suite's `two_device_tiny_run`): rollouts and
    train batches split over the data axis give the metrics of the 1-device run (the suite's
    `finished_tiny_run`, the same command without the mesh); a micro-batch that does not split is
    refused. The train step's two programs are compiled once each, beside the first rollout (one
    thread), none in the loop: the later micro-steps and steps take what the first ones returned."""
    one_device, _ = finished_tiny_run
    workdir, output = two_device_tiny_run
    assert Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() == 3
    compiles = re.findall(r"(\d+) pxla\.py:\d+\] Compiling jit\((micro_fn|update_fn)\)", output)
    assert sorted(f for _, f in compiles) == ["micro_fn", "update_fn"], compiles
    assert len({thread for thread, _ in compiles}) == 1, compiles
    metrics = {name: read_scalars(os.path.join(w, "tensorboard")) for name, w in (("one", one_device), ("dp", workdir))}
    assert "mesh {'data': 2, 'model': 1}" in output
    for tag in ("train/entropy", "train/grad_norm", "rollout/response_length_mean"):
        one, dp = np.array(metrics["one"][tag])[:, 1], np.array(metrics["dp"][tag])[:, 1]
        assert one.shape == (3,) and np.all(np.isfinite(one)), tag
        np.testing.assert_allclose(dp, one, rtol=2e-3, err_msg=tag)
    cmd = [sys.executable, "-m", "qerl_jax.main", *TWO_DEVICE_RUN_FLAGS, f"--config.workdir={tmp_path / 'dp'}",
           "--config.rl.micro_batch_size=3"]  # fmt: skip
    bad = subprocess.run(cmd, cwd=REPO, env=two_device_env(), capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "must be a multiple of mesh.data" in bad.stderr


def test_dynamic_sampling_on_a_two_device_mesh(tmp_path, tiny_model_dir):
    """DAPO's refills in one call on 2 (CPU) devices, each data shard keeping its half of the
    groups: a 2-step run keeps 4 groups a step and gives back the loader batches it did not need."""
    env = two_device_env(PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={tmp_path}",
        f"--config.model.path={tiny_model_dir}", "--config.model.tiny=False", "--config.train.total_steps=2",
        "--config.eval.num_examples=0", "--config.mesh.data=2", "--config.rl.dynamic_sampling=True",
        "--config.rl.max_refill_rounds=3", "--config.rl.reward=worker_rewards:hashed_reward",
        "--config.rollout.max_new_tokens=8",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    scalars = read_jsonl_scalars(os.path.join(tmp_path, "tensorboard"))
    assert [v for _, v in scalars["rollout/groups_kept"]] == [4.0, 4.0]
    batches = [v for _, v in scalars["rollout/prompt_batches"]]
    assert max(batches) >= 2 and max(batches) <= 4, batches  # a refill was needed, not every batch
    assert all(4 <= v <= 4 * b for (_, v), b in zip(scalars["rollout/groups_sampled"], batches))


def test_aqn_arm_at_sigma_zero_samples_the_same_rollouts_as_the_plain_arm(tmp_path, tiny_model_dir):
    """Runs pair across arms: same seed, AQN on (stage 0, sigma 0) or off -> the same step-0 rollouts
    (the rollout key and the norms do not depend on the arm); at step 1 (stage 1, sigma > 0) the
    AQN arm's rollouts differ while its LoRA is still the plain arm's."""
    runs = {}
    for aqn in (False, True):
        cfg = _config(tmp_path / str(aqn), tiny_model_dir, **{"train.total_steps": 2, "aqn.enabled": aqn})
        cfg.aqn.sigma_start = 0.5  # visible in a float32 tiny model's samples at once
        train.train(cfg)
        runs[aqn] = read_jsonl_scalars(os.path.join(cfg.workdir, "tensorboard"))
    assert runs[True]["aqn/sigma"] == [(0, 0.0), (1, 0.5)]
    for tag in ("rollout/entropy_mc", "train/sampler_abs_log_ratio", "rollout/response_length_mean", "train/loss"):
        assert runs[True][tag][0] == runs[False][tag][0], tag  # step 0: bit-identical
    assert runs[True]["rollout/entropy_mc"][1] != runs[False]["rollout/entropy_mc"][1]


def test_mismatch_correction_run_logs_its_weights(tmp_path, tiny_model_dir):
    cfg = _config(
        tmp_path,
        tiny_model_dir,
        **{
            "train.total_steps": 2,  # the last step samples with AQN noise on (stage 1)
            "train.checkpoint_every": 100,
            "rl.reward": DIGIT_REWARD,
            "rl.loss": "bnpo",
            "rl.old_logp_source": "current",
            "rl.is_correction": "token_truncate",
            "rl.is_cap": 1.001,
        },
    )
    metrics = train.train(cfg)
    # the sampler has AQN noise in its norms: weights differ from 1 (~1e-3 on this tiny model), some above the cap
    assert metrics["train/sampler_kl"] > 0
    assert 0 < metrics["train/is_clip_frac"] < 1
    assert metrics["train/is_weight_max"] <= 1.001 + 1e-6
    assert metrics["train/is_weight_mean"] != 1.0


def test_rollout_metrics_give_the_trained_completions_length_quantiles():
    from types import SimpleNamespace

    lengths = np.array([3, 40, 7, 12, 100, 5, 9, 20], np.int32)
    rollout = SimpleNamespace(lengths=lengths, truncated=lengths == 100)
    exp = SimpleNamespace(rollout=rollout, rewards=np.zeros(8), accuracy=np.zeros(8))
    m = train._rollout_metrics(exp)
    ordered = np.sort(lengths).astype(np.float64)

    def quantile(q):  # linear interpolation between the order statistics at rank q * (n - 1)
        at = q * (len(ordered) - 1)
        low = int(at)
        return ordered[low] + (at - low) * (ordered[low + 1] - ordered[low])

    assert (m["rollout/response_length_p50"], m["rollout/response_length_max"]) == ((9 + 12) / 2, 100.0)
    for q in (0.1, 0.5, 0.9):
        assert m[f"rollout/response_length_p{round(q * 100)}"] == pytest.approx(quantile(q))
    assert m["rollout/truncated_frac"] == 1 / 8


def test_rollout_norms_are_the_trained_scales_plus_the_steps_aqn_noise():
    from qerl_jax import aqn

    rng = np.random.default_rng(0)
    frozen = {
        "final_norm": rng.normal(1, 0.1, 16).astype(np.float32),
        "layers": {
            k: rng.normal(1, 0.1, (3, 16)).astype(np.float32) for k in ("input_layernorm", "post_attention_layernorm")
        },
    }
    trained = {"layers": {k: w + rng.normal(0, 0.5, w.shape).astype(np.float32) for k, w in frozen["layers"].items()}}
    key = jax.random.key(7)
    on = aqn.AQNConfig(enabled=True, total_steps=10, num_stages=2, sigma_start=0.05, sigma_end=0.05)
    noisy = train.rollout_norms(on, key, frozen, trained, 6)
    clean_noise = jax.tree.map(lambda a, b: np.asarray(a) - b, aqn.apply_aqn(on, frozen, key, 6), frozen)
    for name, w in trained["layers"].items():
        np.testing.assert_allclose(np.asarray(noisy["layers"][name]) - w, clean_noise["layers"][name], atol=1e-6)
        assert np.abs(clean_noise["layers"][name]).max() > 0.01
    final_noise = np.asarray(noisy["final_norm"]) - frozen["final_norm"]
    np.testing.assert_allclose(final_noise, clean_noise["final_norm"], atol=1e-6)
    off = train.rollout_norms(aqn.AQNConfig(enabled=False), key, frozen, trained, 6)
    for name, w in trained["layers"].items():
        np.testing.assert_array_equal(np.asarray(off["layers"][name]), w)
    assert train.rollout_norms(aqn.AQNConfig(enabled=False), key, frozen, None, 6) is frozen


def test_trained_norms_run_resumes_exactly_and_exports_them(tmp_path, tiny_model_dir):
    """lora.train_norms: the norms move, a killed-and-resumed run reproduces the straight one (norms
    included), and the run's checkpoint and its PEFT adapter give eval the same trained norms."""
    from qerl_jax import evaluation
    from qerl_jax.policy import load_policy

    run = {"train.total_steps": 2, "train.checkpoint_every": 2, "rl.reward": DIGIT_REWARD, "lora.train_norms": True}
    straight = _config(tmp_path / "straight", tiny_model_dir, **run)
    train.train(straight)
    train.train(_config(tmp_path / "resumed", tiny_model_dir, **run, **{"train.stop_after_steps": 1}))
    resumed = _config(tmp_path / "resumed", tiny_model_dir, **run, **{"resume": True})
    train.train(resumed)

    policy = load_policy(run_config.from_config_dict(straight))
    states = []
    for cfg in (straight, resumed):
        cfg.eval.checkpoint = cfg.workdir
        lora_, norms, _ = evaluation.load_adapter(run_config.from_config_dict(cfg), policy)
        states.append((lora_, norms))
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    m_ref = _scalars_without_timing(os.path.join(straight.workdir, "tensorboard"))
    assert m_ref == _scalars_without_timing(os.path.join(resumed.workdir, "tensorboard"))
    trained = states[0][1]
    initial = np.asarray(policy.frozen["norms"]["layers"]["input_layernorm"])
    assert np.abs(np.asarray(trained["layers"]["input_layernorm"]) - initial).max() > 1e-4

    straight.eval.checkpoint = os.path.join(straight.workdir, "adapter")
    _, adapter_norms, _ = evaluation.load_adapter(run_config.from_config_dict(straight), policy)
    for a, b in zip(jax.tree.leaves(adapter_norms), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plain = _config(tmp_path / "plain", tiny_model_dir, **{**run, "lora.train_norms": False})
    plain.eval.checkpoint = straight.workdir  # the run's own config decides, not the eval config's
    assert evaluation.load_adapter(run_config.from_config_dict(plain), policy)[1] is not None


def test_the_first_train_step_finds_its_programs_compiled_from_train_batch_like(tmp_path, tiny_model_dir):
    """`train_batch_like` has the packed shapes and dtypes `make_train_batch` gives a real step's
    experience (long and short completions): per-sequence arrays equal, rows a multiple of the
    micro-batch of the same width. After `precompile` on it (what the run does beside its first
    rollout), the first train step on the real batch compiles neither of its two programs."""
    from qerl_jax.policy import load_policy
    from qerl_jax.rollout import prompt_bucket
    from qerl_jax.rollout.batch import RolloutBatch

    overrides = {"rl.micro_batch_size": 4}  # the real batch: several micro-batches
    cfg = _run(tmp_path, tiny_model_dir, **overrides)
    policy = load_policy(cfg)
    sizes = train._check_memory(cfg, policy)  # remat "auto" resolved, as the run does
    g, n = cfg.rollout.group_size, cfg.rollout.prompts_per_step * cfg.rollout.group_size
    p, m = prompt_bucket(cfg.data.max_prompt_len), cfg.rollout.max_new_tokens
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, m + 1, n).astype(np.int32)
    lengths[0] = m
    resp = (np.arange(m)[None] < lengths[:, None]).astype(np.int32)
    starts = rng.integers(p - cfg.data.max_prompt_len, p, n)  # prompts of at most max_prompt_len tokens
    prompt_mask = (np.arange(p)[None] >= starts[:, None]).astype(np.int32)
    rollout = RolloutBatch(
        prompt_ids=jax.numpy.asarray(rng.integers(1, 50, (n, p)) * prompt_mask, np.int32),
        prompt_mask=jax.numpy.asarray(prompt_mask),
        tokens=jax.numpy.asarray(rng.integers(1, 50, (n, m)) * resp, np.int32),
        logprobs=jax.numpy.asarray(-rng.random((n, m)) * resp, np.float32),
        response_mask=jax.numpy.asarray(resp),
        lengths=jax.numpy.asarray(lengths),
        decoded=jax.numpy.asarray(lengths),
        truncated=jax.numpy.asarray(lengths == m),
        prompt_index=jax.numpy.asarray(np.arange(n) // g, np.int32),
        steps=jax.numpy.asarray([m], np.int32),
        group_size=g,
    )
    exp = train.Experience(
        rollout=rollout, answers=[""] * n, completions=[""] * n, prompts=[""] * n,
        rewards=rng.random(n).astype(np.float32), accuracy=np.zeros(n, np.float32), groups_sampled=n // g,
        groups_kept=n // g,
    )  # fmt: skip
    mb = sizes.micro_batch_size
    real, like = train.make_train_batch(cfg, exp, mb), train.train_batch_like(cfg, mb)
    assert real.keys() == like.keys()
    for k in real:
        assert real[k].dtype == like[k].dtype, k
        if k in ("input_ids", "segment_ids"):
            assert real[k].shape[1:] == like[k].shape[1:] and real[k].shape[0] % mb == like[k].shape[0] % mb == 0
        else:
            assert real[k].shape == like[k].shape, k
    assert real["input_ids"].shape[0] > mb  # the real batch has several micro-batches
    optimizer, lr_fn = run_config.optimizer_from_config(cfg)
    state = _train_state_like(_config(tmp_path, tiny_model_dir, **overrides))
    step = train.make_step(cfg, policy, optimizer, lr_fn, sizes)
    step.precompile(state, policy.frozen, like)
    compiled = []
    listener = lambda event, secs, **kw: compiled.append(kw.get("fun_name")) if event.endswith("backend_compile_duration") else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        new_state, metrics = step(state, policy.frozen, real)
        jax.block_until_ready(metrics)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not [name for name in compiled if "micro_fn" in name or "update_fn" in name], compiled
    assert int(new_state.step) == 1


def test_a_failed_background_compile_is_a_warning_and_the_step_compiles_itself(caplog):
    """The train step's compile beside the rollout may fail (e.g. out of memory next to it): the run
    goes on, the step compiling its programs when it first runs; no compile started, no wait."""
    import concurrent.futures

    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("RESOURCE_EXHAUSTED: out of memory"))
    with caplog.at_level("WARNING"):
        train._await_precompile(failed)
        train._await_precompile(None)
    assert "compiling it now" in caplog.text and "RESOURCE_EXHAUSTED" in caplog.text


def test_the_train_step_on_fp8_copies_compiles_with_the_fp8_options(tmp_path, tiny_model_dir, monkeypatch):
    """make_step's fp8_copies gives the micro-step program fp8.TRAIN_COMPILER_OPTIONS (cuBLASLt's FP8
    GEMMs, no Triton autotuning) and only it; the options are ones this jaxlib's XLA accepts."""
    from types import SimpleNamespace

    from qerl_jax import fp8, memory
    from qerl_jax.rl import step as rl_step

    assert float(jax.jit(lambda x: x @ x.T, compiler_options=fp8.TRAIN_COMPILER_OPTIONS)(np.eye(2)).sum()) == 2.0
    seen, real_jit = [], jax.jit
    record = lambda f, **kw: seen.append((f.__name__, kw.get("compiler_options"))) or real_jit(f, **kw)  # noqa: E731
    monkeypatch.setattr(rl_step.jax, "jit", record)
    cfg = _run(tmp_path, tiny_model_dir)
    policy = SimpleNamespace(config=None, backend="xla")
    sizes = memory.Resolved(micro_batch_size=1, logprob_chunk=16, remat="none", max_batch=0)
    optimizer, lr_fn = run_config.optimizer_from_config(cfg)
    for fp8_copies, options in ((True, fp8.TRAIN_COMPILER_OPTIONS), (False, None)):
        seen.clear()
        train.make_step(cfg, policy, optimizer, lr_fn, sizes, fp8_copies=fp8_copies)
        assert dict(seen) == {"micro_fn": options, "update_fn": None}
