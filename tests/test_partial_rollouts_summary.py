"""experiments/partial_rollouts/summarize.py: the rules of its PROTOCOL.md applied to synthetic runs, the
numbers recomputed here with numpy."""

import json
import os

import numpy as np
import pytest

from experiments.partial_rollouts import summarize

STEPS = 40


def _run(workdir, *, step_s, rollout_s, reward, seed, partial):
    """A run's scalars.jsonl: constant times, reward(t) + noise, eval rows interleaved (not train steps)."""
    os.makedirs(os.path.join(workdir, "tensorboard"))
    rng = np.random.default_rng(seed)
    with open(os.path.join(workdir, "tensorboard", "scalars.jsonl"), "w") as f:
        for t in range(STEPS):
            row = {"step": t, "time/step_s": step_s * (5 if t == 0 else 1), "time/rollout_s": rollout_s,
                   "time/reward_s": 0.1, "reward/mean_sampled": reward(t) + 0.02 * rng.standard_normal()}  # fmt: skip
            if partial:
                row["rollout/offpolicy_tokens_frac"] = 0.3
            f.write(json.dumps(row) + "\n")
            f.write(json.dumps({"step": t, "eval/gsm8k_test/pass_at_1": 0.5}) + "\n")
    return workdir


def _eval(path, pass_at_1):
    os.makedirs(path)
    datasets = {"gsm8k_test": {"pass_at_1": pass_at_1, "num_examples": 1319}}
    json.dump({"datasets": datasets}, open(f"{path}/summary.json", "w"))
    return f"{path}/summary.json"


def _args(tmp_path, b_reward, b_step, b_rollout, finals):
    args = []
    for seed in (0, 1):
        arms = (("a", 8.0, 5.0, lambda t: 0.4 + 0.004 * t), ("b", b_step, b_rollout, b_reward))
        for arm, step_s, rollout_s, reward in arms:
            run = _run(tmp_path / f"{arm}{seed}", step_s=step_s, rollout_s=rollout_s, reward=reward, seed=seed,
                       partial=arm == "b")  # fmt: skip
            args += ["--run", arm, str(seed), str(run)]
            args += ["--eval", arm, str(seed), _eval(str(tmp_path / f"e{arm}{seed}"), finals[arm][seed])]
    return args


def _rewards(path):
    return [r["reward/mean_sampled"] for r in map(json.loads, open(path)) if "time/step_s" in r]


def test_a_fast_equal_partial_arm_meets_every_rule(tmp_path):
    finals = {"a": (0.60, 0.62), "b": (0.605, 0.61)}
    args = _args(tmp_path, lambda t: 0.4 + 0.004 * t, 5.0, 2.5, finals)
    out = summarize.main([*args, "--out", str(tmp_path / "s.json")])
    assert json.load(open(tmp_path / "s.json"))["speed"] == out["speed"]
    # rule 1: steps 1-39, b's mean over a's; rollout + reward
    assert out["speed"]["per_seed"][0]["steps"] == 39
    assert out["speed"]["step_ratio"] == pytest.approx(5.0 / 8.0)
    assert out["speed"]["rollout_ratio"] == pytest.approx(2.6 / 5.1)
    assert out["speed"]["verdict"] == "met" and out["protocol"].endswith("rules v1")
    # rule 2: the paired difference over steps 10-39, per seed, then over seeds
    b0, a0 = (_rewards(tmp_path / f"{arm}0/tensorboard/scalars.jsonl") for arm in "ba")
    assert out["reward"]["per_seed"][0]["value"] == pytest.approx(np.mean(np.subtract(b0, a0)[10:40]))
    assert out["reward"]["verdict"] == "supported"
    # rule 3: the mean over seeds of b - a against -1 point
    assert out["accuracy"]["diff"] == pytest.approx(np.mean(finals["b"]) - np.mean(finals["a"]))
    assert out["accuracy"]["verdict"] == "met"
    assert out["reported_means"]["b0"]["rollout/offpolicy_tokens_frac"] == pytest.approx(0.3)
    assert out["reported_means"]["a0"]["rollout/offpolicy_tokens_frac"] is None


def test_a_slow_worse_partial_arm_misses_them(tmp_path):
    finals = {"a": (0.60, 0.62), "b": (0.58, 0.60)}
    out = summarize.main([*_args(tmp_path, lambda t: 0.3 + 0.004 * t, 6.0, 2.5, finals), "--rules", "v2"])
    assert out["protocol"].endswith("rules v2")  # K = 2 judged by the same rules
    assert out["speed"]["verdict"] == "missed"  # the step 0.75x: over 0.70
    assert out["reward"]["verdict"] == "not supported"  # 0.1 lower throughout: past the 0.03 margin
    assert out["accuracy"]["verdict"] == "missed"  # 2 points lower


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--run", "c", "0", "/nowhere"], "ARM must be a (on-policy) or b"),
        (["--run", "a", "x", "/nowhere"], "SEED a number; got 'a' 'x'"),
        (["--run", "a", "0", "/nowhere"], "/nowhere/tensorboard/scalars.jsonl does not exist"),
        (["--rules", "v3"], "--rules must be one of v1, v2; got 'v3'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, args, expected):
    with pytest.raises(SystemExit) as e:
        summarize.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1
