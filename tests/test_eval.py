"""The eval command end to end on a tiny random model: files, metrics, adapters."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, load_config

from qerl_jax import evaluation
from qerl_jax.errors import UserFacingError


def _cfg(tmp_path, model_dir, **eval_overrides):
    cfg = load_config("tiny")
    cfg.workdir = str(tmp_path)
    cfg.model.tiny = False
    cfg.model.path = model_dir
    cfg.eval.num_examples = 8
    cfg.eval.max_new_tokens = 8
    for k, v in eval_overrides.items():
        cfg.eval[k] = v
    return cfg


def test_eval_command_writes_jsonl_and_summary(tmp_path, tiny_model_dir):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out_dir = tmp_path / "eval_out"
    cmd = [
        sys.executable,
        "-m",
        "qerl_jax.eval",
        "--config=configs/tiny.py",
        f"--config.workdir={tmp_path}",
        "--config.model.tiny=False",
        f"--config.model.path={tiny_model_dir}",
        "--config.eval.num_examples=8",
        "--config.eval.max_new_tokens=8",
        "--config.eval.num_samples=2",
        f"--config.eval.output_dir={out_dir}",
    ]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.load(open(out_dir / "summary.json"))
    ((name, result),) = summary["datasets"].items()
    # what it evaluated and where it wrote, said on stdout (today: only the metrics)
    lines = run.stdout.splitlines()
    assert "adapter: none (eval.checkpoint is empty): the base model" in lines
    kept = f"{result['num_examples']} examples"
    assert any(line.startswith("dataset ") and line.split(": ", 1)[1].startswith(kept) for line in lines), lines
    assert f"outputs: {out_dir} ({name}.jsonl, summary.json, tensorboard/)" in lines
    assert result["num_examples"] + result["skipped_too_long"] == 8
    assert 0.0 <= result["pass_at_1"] <= 1.0 and 0.0 <= result["mean_at_2"] <= 1.0
    rows = [json.loads(line) for line in open(out_dir / f"{name}.jsonl")]
    assert len(rows) == result["num_examples"] * 3  # greedy + 2 samples per prompt
    assert {"prompt", "completion", "extracted_answer", "answer", "correct"} <= set(rows[0])
    assert summary["model"]["quant"] == "nvfp4"
    assert any(f.startswith("events") for f in os.listdir(out_dir / "tensorboard"))


def test_greedy_eval_is_deterministic_and_scores_match_rewards(tmp_path, tiny_model_dir):
    from qerl_jax import rewards

    cfg = _cfg(tmp_path, tiny_model_dir)
    a = evaluation.evaluate(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.workdir, "eval", "gsm8k_test.jsonl"))]
    cfg.eval.output_dir = str(tmp_path / "again")
    b = evaluation.evaluate(cfg)
    assert a["metrics"]["gsm8k_test/pass_at_1"] == b["metrics"]["gsm8k_test/pass_at_1"]
    again = [json.loads(line) for line in open(tmp_path / "again" / "gsm8k_test.jsonl")]
    assert [r["completion"] for r in rows] == [r["completion"] for r in again]
    for r in rows:
        assert r["correct"] == (rewards.accuracy_reward(r["completion"], r["answer"]) == 1.0)


def test_per_problem_outputs_are_kept_compressed(tmp_path, tiny_model_dir):
    """Every evaluation keeps a gzip jsonl of (metric, problem id, correct, length) beside its summary."""
    import gzip

    cfg = _cfg(tmp_path, tiny_model_dir, num_samples=2)
    cfg.eval.num_examples = 4
    summary = evaluation.evaluate(cfg)
    out = os.path.join(cfg.workdir, "eval")
    full = [json.loads(line) for line in open(os.path.join(out, "gsm8k_test.jsonl"))]
    with gzip.open(os.path.join(out, "gsm8k_test" + evaluation.PROBLEMS_SUFFIX), "rt") as f:
        rows = [json.loads(line) for line in f]
    assert rows == [{"metric": r["metric"], "id": r["source_id"], "correct": r["correct"], "length": r["length"]} for r in full]
    greedy = [r for r in rows if r["metric"] == "pass_at_1"]
    assert len(greedy) == summary["datasets"]["gsm8k_test"]["num_examples"] and len(rows) == 3 * len(greedy)
    assert len({r["id"] for r in greedy}) == len(greedy)  # one row per problem: pairs by id
    assert np.mean([r["correct"] for r in greedy]) == pytest.approx(summary["datasets"]["gsm8k_test"]["pass_at_1"])
    lengths = [r["length"] for r in greedy]
    assert all(0 < n <= cfg.eval.max_new_tokens for n in lengths)
    assert np.mean(lengths) == pytest.approx(summary["datasets"]["gsm8k_test"]["pass_at_1_response_length"])


def test_peft_adapter_is_applied(tmp_path, tiny_model_dir):
    """An adapter that changes the model changes the completions; a zero one does not."""
    from qerl_jax.model_io.loader import load_model
    from qerl_jax.model_io.peft_adapter import export_peft_adapter

    config, params = load_model(tiny_model_dir)
    rng = np.random.default_rng(0)
    layers = {}
    for proj in ("q_proj", "down_proj"):
        L, n, k = params["base"]["layers"][proj]["w"].shape
        layers[proj] = {
            "a": rng.normal(0, 1.0, (L, 4, k)).astype(np.float32),
            "b": rng.normal(0, 1.0, (L, n, 4)).astype(np.float32),
        }
    strong = export_peft_adapter({"layers": layers}, str(tmp_path / "strong"), rank=4, alpha=64.0)
    zero = {p: {"a": v["a"], "b": np.zeros_like(v["b"])} for p, v in layers.items()}
    zeroed = export_peft_adapter({"layers": zero}, str(tmp_path / "zero"), rank=4, alpha=64.0)

    def completions(checkpoint, out):
        cfg = _cfg(tmp_path, tiny_model_dir, checkpoint=checkpoint, output_dir=str(tmp_path / out))
        evaluation.evaluate(cfg)
        return [json.loads(l)["completion"] for l in open(tmp_path / out / "gsm8k_test.jsonl")]

    base = completions("", "base")
    assert completions(zeroed, "zero") == base
    assert completions(strong, "strong") != base


def test_missing_checkpoint_is_clear(tmp_path, tiny_model_dir):
    cfg = _cfg(tmp_path, tiny_model_dir, checkpoint=str(tmp_path / "nope"))
    with pytest.raises(UserFacingError, match="does not exist"):
        evaluation.evaluate(cfg)


def _eval_cli(tmp_path, model_dir, *overrides):
    cmd = [sys.executable, "-m", "qerl_jax.eval", "--config=configs/tiny.py", f"--config.workdir={tmp_path / 'run'}",
           "--config.model.tiny=False", f"--config.model.path={model_dir}", "--config.eval.num_examples=4",
           "--config.eval.max_new_tokens=4", *overrides]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert not (tmp_path / "run" / "eval").exists()  # no results written
    return line


def test_a_broken_or_foreign_adapter_and_all_prompts_too_long_are_one_line(tmp_path, tiny_model_dir):
    from qerl_jax.model_io.peft_adapter import ADAPTER_WEIGHTS, export_peft_adapter

    rng = np.random.default_rng(0)
    three = {"q_proj": {"a": rng.normal(size=(3, 4, 64)).astype(np.float32),
                        "b": rng.normal(size=(3, 64, 4)).astype(np.float32)}}
    foreign = export_peft_adapter({"layers": three}, str(tmp_path / "foreign"), rank=4, alpha=8.0)
    line = _eval_cli(tmp_path, tiny_model_dir, f"--config.eval.checkpoint={foreign}")
    assert f"eval.checkpoint = {foreign!r}" in line and "covers layers [0, 1, 2], but the model has 2" in line

    os.remove(os.path.join(foreign, ADAPTER_WEIGHTS))
    line = _eval_cli(tmp_path, tiny_model_dir, f"--config.eval.checkpoint={foreign}")
    assert f"eval.checkpoint = {foreign!r}: a PEFT adapter folder without its weights file {ADAPTER_WEIGHTS}" in line

    line = _eval_cli(tmp_path, tiny_model_dir, "--config.data.max_prompt_len=8")
    assert "data.max_prompt_len = 8: every one of the 4 prompts" in line and "raise data.max_prompt_len" in line


def test_eval_of_a_run_says_which_checkpoint_it_loaded(tmp_path, finished_tiny_run):
    run, _ = finished_tiny_run
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "qerl_jax.eval", "--config=configs/tiny.py", f"--config.workdir={run}",
           f"--config.eval.checkpoint={run}", "--config.eval.num_examples=2", "--config.eval.max_new_tokens=4",
           f"--config.eval.output_dir={out_dir}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert f"checkpoint: {run / 'checkpoints' / '3'} (step 3: LoRA rank 8, alpha 16, trained norms: no)" in lines
    assert "dataset " + load_config("tiny").eval.datasets[0] + ": 2 examples" in lines
    assert f"outputs: {out_dir} (gsm8k_test.jsonl, summary.json, tensorboard/)" in lines
    assert not os.path.exists(run / "eval")
