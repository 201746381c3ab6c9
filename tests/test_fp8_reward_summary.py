"""experiments/fp8_reward/summarize.py: the rules of its PROTOCOL.md applied to synthetic runs, the numbers
recomputed here with numpy."""

import json
import os

import numpy as np
import pytest

from experiments.fp8_reward import summarize

STEPS = 40


def _run(workdir, *, train_s, reward, seed):
    """A run's scalars.jsonl: constant times, reward(t) + noise, an eval row per step (not a train step)."""
    os.makedirs(os.path.join(workdir, "tensorboard"))
    rng = np.random.default_rng(seed)
    with open(os.path.join(workdir, "tensorboard", "scalars.jsonl"), "w") as f:
        for t in range(STEPS):
            row = {"step": t, "time/step_s": 5.0 + train_s + (30 if t == 0 else 0), "time/rollout_s": 5.0,
                   "time/train_s": train_s, "train/sampler_kl": 0.001 * (1 + seed),
                   "reward/mean_sampled": reward(t) + 0.02 * rng.standard_normal()}  # fmt: skip
            f.write(json.dumps(row) + "\n")
            f.write(json.dumps({"step": t, "eval/gsm8k_test/pass_at_1": 0.5}) + "\n")
    return workdir


def _eval(path, pass_at_1):
    os.makedirs(path)
    json.dump({"datasets": {"gsm8k_test": {"pass_at_1": pass_at_1, "num_examples": 1319}}}, open(f"{path}/summary.json", "w"))
    return f"{path}/summary.json"


def _args(tmp_path, b_reward, finals):
    args = []
    for seed in (0, 1):
        for arm, train_s, reward in (("a", 3.0, lambda t: 0.4 + 0.004 * t), ("b", 2.0, b_reward)):
            run = _run(tmp_path / f"{arm}{seed}", train_s=train_s, reward=reward, seed=seed)
            args += ["--run", arm, str(seed), str(run)]
            args += ["--eval", arm, str(seed), _eval(str(tmp_path / f"e{arm}{seed}"), finals[arm][seed])]
        args += ["--fp8-eval", str(seed), _eval(str(tmp_path / f"f{seed}"), 0.59)]
    return args


def _rewards(path):
    return [r["reward/mean_sampled"] for r in map(json.loads, open(path)) if "time/step_s" in r]


def test_an_equal_fp8_arm_meets_both_rules(tmp_path):
    finals = {"a": (0.60, 0.62), "b": (0.605, 0.61)}
    out = summarize.main([*_args(tmp_path, lambda t: 0.4 + 0.004 * t, finals), "--out", str(tmp_path / "s.json")])
    assert json.load(open(tmp_path / "s.json"))["reward"]["verdict"] == out["reward"]["verdict"] == "supported"
    # rule 1: the paired difference over steps 0-39, per seed
    b0, a0 = (_rewards(tmp_path / f"{arm}0/tensorboard/scalars.jsonl") for arm in "ba")
    assert out["reward"]["per_seed"][0]["steps"] == 40
    assert out["reward"]["per_seed"][0]["value"] == pytest.approx(np.mean(np.subtract(b0, a0)))
    # rule 2: the mean over seeds of b - a against -1 point
    assert out["accuracy"]["diff"] == pytest.approx(np.mean(finals["b"]) - np.mean(finals["a"]))
    assert out["accuracy"]["verdict"] == "met"
    # reported: times over steps 1-39 (step 0 compiles), b / a; the sampler KL; arm b evaluated with FP8
    assert out["time_ratios"][0]["time/train_s"] == pytest.approx(2.0 / 3.0)
    assert out["time_ratios"][0]["time/step_s"] == pytest.approx(7.0 / 8.0) and out["time_ratios"][0]["steps"] == 39
    assert out["reported_means"]["b1"]["train/sampler_kl"] == pytest.approx(0.002)
    assert out["reported_means"]["a0"]["train/clip_frac"] is None  # not logged by these runs
    assert out["b_with_fp8_eval"] == {0: 0.59, 1: 0.59}


def test_a_worse_fp8_arm_misses_them(tmp_path):
    finals = {"a": (0.60, 0.62), "b": (0.58, 0.60)}
    out = summarize.main(_args(tmp_path, lambda t: 0.3 + 0.004 * t, finals))
    assert out["reward"]["verdict"] == "not supported"  # 0.1 lower throughout: past the 0.03 margin
    assert out["accuracy"]["verdict"] == "missed"  # 2 points lower


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--run", "c", "0", "/nowhere"], "ARM must be a (fp8_matmul=off) or b"),
        (["--fp8-eval", "x", "/nowhere"], "--fp8-eval SEED: SEED must be a number; got 'x'"),
        (["--run", "a", "0", "/nowhere"], "/nowhere/tensorboard/scalars.jsonl does not exist"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, args, expected):
    with pytest.raises(SystemExit) as e:
        summarize.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1
