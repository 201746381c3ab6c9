"""experiments/fidelity/summarize.py on synthetic runs: the verdicts follow the numbers."""

import json
import os

import numpy as np
import pytest

from experiments.fidelity import summarize

STEPS = 40


def _comparison(mean, half_width):
    return {"mean_diff": mean, "se": half_width / 1.96, "ci95": [mean - half_width, mean + half_width], "n_prompts": 64}


def _write_experiment(out, slopes, entropy_diff=(0.2, 0.05), steps_done=STEPS):
    os.makedirs(out, exist_ok=True)
    json.dump({"steps": STEPS, "tiny": False, "gguf": "m.gguf"}, open(os.path.join(out, "experiment.json"), "w"))
    rng = np.random.default_rng(0)
    for arm, slope in slopes.items():
        for seed in range(3):
            tb = os.path.join(out, "runs", arm, f"seed{seed}", "tensorboard")
            os.makedirs(tb)
            with open(os.path.join(tb, "scalars.jsonl"), "w") as f:
                for step in range(steps_done):
                    r = 0.05 + slope * step / 100 + rng.normal(0, 0.01)
                    row = {"step": step, "aqn/sigma": 0.0, "reward/mean_sampled": r, "rollout/entropy_mc": 1.0}
                    f.write(json.dumps(row) + "\n")
                f.write(json.dumps({"step": STEPS, "eval/arithmetic_test/pass_at_1": 0.3}) + "\n")  # not a step
    base = os.path.join(out, "base")
    os.makedirs(base)
    mean, half = entropy_diff
    comparisons = {
        k: _comparison(mean, half)
        for k in (
            "nvfp4_minus_bf16_entropy",
            "nvfp4_minus_bf16_neg_logp",
            "nvfp4_minus_bf16_entropy_same_tokens",
            "nvfp4_aqn_minus_bf16_entropy",
        )
    }
    models = {m: {"entropy": 1.0 + (mean if m != "bf16" else 0.0)} for m in ("bf16", "nvfp4", "nvfp4_aqn")}
    entropy = {"group_size": 4, "aqn_sigma": 0.01, "models": models, "comparisons": comparisons}
    json.dump(entropy, open(os.path.join(base, "entropy.json"), "w"))


def test_verdicts_follow_the_slopes_and_intervals(tmp_path):
    out = str(tmp_path / "out")
    slopes = {"bf16": 0.1, "nvfp4": 0.2, "nvfp4_aqn": 0.4, "nvfp4_aqn_current": 0.4}
    _write_experiment(out, slopes)
    s = summarize.summarize(out, str(tmp_path / "results"))
    assert {k: c["verdict"] for k, c in s["claims"].items()} == {
        "a": "supported",
        "b": "supported",
        "c": "supported",
        "ratio_source": "does not change (b)",
    }
    assert s["common_steps"] == STEPS  # the evaluation's row at step STEPS is not a train step
    np.testing.assert_allclose(s["arms"]["nvfp4"]["reward_slope_per_100"][0], 0.2, atol=0.02)
    for name in ("fidelity.png", "results.md", "summary.json", "curves.json"):
        assert os.path.isfile(tmp_path / "results" / name)


@pytest.mark.parametrize(
    "slopes,entropy_diff,want",
    [
        ({"bf16": 0.4, "nvfp4": 0.1, "nvfp4_aqn": 0.1}, (-0.2, 0.05), {"a": "not supported", "b": "not supported"}),
        ({"bf16": 0.2, "nvfp4": 0.2, "nvfp4_aqn": 0.1}, (0.005, 0.01), {"a": "not supported", "c": "not supported"}),
        ({"bf16": 0.0, "nvfp4": 0.0, "nvfp4_aqn": 0.0}, (0.1, 0.3), {"a": "inconclusive", "b": "inconclusive"}),
    ],
    ids=["nvfp4_slower_lower_entropy", "same_entropy_aqn_worse", "nothing_moved"],
)
def test_negative_and_inconclusive_verdicts(tmp_path, slopes, entropy_diff, want):
    out = str(tmp_path / "out")
    _write_experiment(out, slopes, entropy_diff)
    claims = summarize.summarize(out, str(tmp_path / "results"))["claims"]
    assert {k: claims[k]["verdict"] for k in want} == want


def test_incomplete_runs_compare_the_common_steps(tmp_path):
    out = str(tmp_path / "out")
    _write_experiment(out, {"bf16": 0.1, "nvfp4": 0.2}, steps_done=25)
    s = summarize.summarize(out, str(tmp_path / "results"))
    assert s["common_steps"] == 25
    assert "(25/40, 0 evaluated)" in open(tmp_path / "results" / "results.md").read()
