"""experiments/aqn_dose and configs/aqn_dose: the config's arms and schedule, the pre-registered
analysis on synthetic scalars, the plan's arithmetic."""

import argparse
import gzip
import json
import os

import numpy as np
import pytest

from configs import aqn_dose
from experiments import launcher
from experiments.aqn_dose import plan, summarize
from experiments.aqn_dose.run import EXPERIMENT
from qerl_jax import aqn, run_config

STEPS = 30  # three stages of 10 steps
PROBLEMS = 400


def test_arms_differ_only_in_aqn_and_every_stage_is_noisy():
    control = aqn_dose.get_config("sigma0").to_dict()
    assert aqn_dose.get_config("sigma0").aqn.enabled is False
    for arm, sigma in aqn_dose.SIGMAS.items():
        cfg = aqn_dose.get_config(arm)
        assert (cfg.model.quant, cfg.optim.lr, cfg.train.total_steps) == ("nvfp4", 1e-5, 180)
        d = cfg.to_dict()
        assert {k: v for k, v in d.items() if k not in ("aqn", "workdir")} == {
            k: v for k, v in control.items() if k not in ("aqn", "workdir")
        }
        if sigma:
            typed = run_config.from_config_dict(cfg)
            assert typed.aqn.enabled and typed.aqn.first_stage_noise
            np.testing.assert_allclose(aqn.stage_sigmas(typed.aqn), [sigma, sigma / 10, sigma / 100], rtol=1e-12)
            np.testing.assert_allclose(summarize.stage_sigmas(arm, 3), aqn.stage_sigmas(typed.aqn), rtol=1e-12)
            assert [aqn.aqn_stage(typed.aqn, t) for t in (0, 59, 60, 119, 120, 179)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="unknown arm"):
        aqn_dose.get_config("sigma5")


def test_the_launcher_runs_every_arm_from_one_tree_with_only_path_seed_and_workdir_set(tmp_path):
    assert EXPERIMENT.same_code and EXPERIMENT.stages == ("train",)
    args = argparse.Namespace(gguf="/m/q.gguf", out=str(tmp_path), steps=180, tiny=False)
    seeds = {arm: launcher.run_config(EXPERIMENT, args, arm, 1) for arm in aqn_dose.ARMS}
    for arm, cfg in seeds.items():
        assert (cfg.seed, cfg.model.path, cfg.aqn.num_stages) == (1, "/m/q.gguf", 3)  # paired: the seed alone picks prompts and keys
        assert cfg.workdir == os.path.join(str(tmp_path), "runs", arm, "seed1")
    assert launcher.parser(EXPERIMENT, "").parse_args(["--out", "o"]).stages == ["train"]
    with pytest.raises(SystemExit):
        launcher.parser(EXPERIMENT, "").parse_args(["--out", "o", "--stages", "base"])
    assert launcher.final_eval_config(EXPERIMENT, args, "sigma1e-1", 0).eval.datasets[0].endswith(os.path.join("gsm8k", "test.jsonl"))


def test_stage_bounds_follow_the_aqn_stage_of_each_step():
    assert summarize.stage_bounds(180, 3) == [(0, 60), (60, 120), (120, 180)]
    cfg = aqn.AQNConfig(enabled=True, num_stages=3, total_steps=10, first_stage_noise=True)
    for k, (lo, hi) in enumerate(summarize.stage_bounds(10, 3)):
        assert [aqn.aqn_stage(cfg, t) for t in range(lo, hi)] == [k] * (hi - lo)


# Synthetic effects per arm: sampler KL added and entropy shift in stage 0, reward slope difference
# per 100 steps, problems lost / won against the control in the final evaluation (per seed).
EFFECTS = {
    "sigma0": dict(kl=0.0, entropy=0.0, slope=0.0, lost=0, won=0),
    "sigma1e-2": dict(kl=0.0, entropy=0.0, slope=0.0, lost=3, won=3),
    "sigma3e-2": dict(kl=1e-4, entropy=0.0, slope=0.0, lost=4, won=2),
    "sigma1e-1": dict(kl=3e-4, entropy=0.02, slope=-2.0, lost=20, won=2),
}


def _write(out, effects=EFFECTS, seeds=(0, 1), noise_kl=True):
    os.makedirs(out, exist_ok=True)
    json.dump({"steps": STEPS, "tiny": False, "gguf": "q.gguf", "sha256": "ab" * 32, "code": "cd" * 32}, open(f"{out}/experiment.json", "w"))
    rng = np.random.default_rng(0)
    for arm, e in effects.items():
        for seed in seeds:
            run = os.path.join(out, "runs", arm, f"seed{seed}")
            os.makedirs(f"{run}/tensorboard")
            prompts = np.random.default_rng(seed).normal(0, 0.05, STEPS)  # the seed's prompts, shared by the arms
            with open(f"{run}/tensorboard/scalars.jsonl", "w") as f:
                for t in range(STEPS):
                    stage0 = t < STEPS // 3
                    row = {
                        "step": t,
                        "aqn/sigma": aqn_dose.SIGMAS[arm],
                        "reward/mean_sampled": 0.5 + prompts[t] + (0.1 + e["slope"]) * t / 100 + rng.normal(0, 3e-4),
                        "rollout/entropy_mc": 0.2 + (e["entropy"] if stage0 else 0.0) + rng.normal(0, 0.001),
                        "train/sampler_kl": 6e-5 + (e["kl"] if stage0 else 0.0) + rng.normal(0, 2e-6),
                        "rollout/truncated_frac": 0.01,
                        "time/step_s": 6.0,
                    }
                    f.write(json.dumps(row) + "\n")
            solved = np.flatnonzero(np.arange(PROBLEMS) % 3 != 0)
            unsolved = np.flatnonzero(np.arange(PROBLEMS) % 3 == 0)
            correct = np.arange(PROBLEMS) % 3 != 0  # the control solves 2/3
            correct[solved[: e["lost"]]] = False
            correct[unsolved[: e["won"]]] = True
            ev = f"{run}/eval/step_{STEPS}"
            os.makedirs(ev)
            datasets = {"gsm8k_test": {"pass_at_1": float(correct.mean()), "num_examples": PROBLEMS}}
            json.dump({"datasets": datasets}, open(f"{ev}/summary.json", "w"))
            with gzip.open(f"{ev}/gsm8k_test.problems.jsonl.gz", "wt") as f:
                for i, ok in enumerate(correct):
                    f.write(json.dumps({"metric": "pass_at_1", "id": f"gsm8k/test/{i}", "correct": bool(ok), "length": 100}) + "\n")
    if noise_kl:
        doses = {str(s): {"kl_nvfp4_to_noised": 0.1 * s * s} for s in (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4)}
        json.dump({"aqn": doses}, open(f"{out}/noise_kl.json", "w"))


def test_the_pre_registered_readings_on_synthetic_runs(tmp_path):
    out, res = str(tmp_path / "out"), str(tmp_path / "res")
    _write(out)
    s = summarize.summarize(out, res)
    arms = s["arms"]
    assert list(arms) == ["sigma1e-2", "sigma3e-2", "sigma1e-1"]
    assert arms["sigma1e-2"]["readings"]["sampler"].startswith("no rise")
    assert arms["sigma3e-2"]["readings"] == {
        "sampler": "raises the sampler/train KL",
        "exploration": "no entropy change shown",
        "growth": "no effect on reward growth as large as ±0.01",
    }
    assert arms["sigma1e-1"]["readings"] == {
        "sampler": "raises the sampler/train KL",
        "exploration": "raises the sampled-token entropy",
        "growth": "slows reward growth",
    }
    st = arms["sigma1e-1"]["stages"]
    assert st[0]["steps"] == [0, 10] and st[0]["sampler_kl_ratio"] == pytest.approx(6.0, rel=0.05)
    assert st[1]["sampler_kl"]["lo"] < 0 < st[1]["sampler_kl"]["hi"]  # no noise effect after stage 0 here
    assert arms["sigma1e-1"]["doses"] == pytest.approx([1e-3, 1e-5, 1e-7])
    acc = arms["sigma1e-1"]["accuracy"]
    assert acc["pooled_mcnemar"]["b_only"] == 4 and acc["pooled_mcnemar"]["a_only"] == 40 and acc["pooled_mcnemar"]["p"] < 1e-6
    assert [p["diff"] for p in acc["per_seed"]] == pytest.approx([-18 / PROBLEMS] * 2)
    assert arms["sigma1e-1"]["suffers"] and not arms["sigma3e-2"]["suffers"]  # -0.5 points: under the 1-point rule
    assert s["answer"] == {
        "sampler": "sigma3e-2",
        "exploration": "sigma1e-1",
        "growth": "sigma1e-1",
        "accuracy": {"threshold": "sigma1e-1", "text": "accuracy starts to suffer at sigma1e-1"},
    }
    md = open(f"{res}/results.md").read()
    assert "accuracy starts to suffer at sigma1e-1" in md and os.path.isfile(f"{res}/aqn_dose.png")
    # Every seed loses the same problems here: a zero-width Welch interval must not read as a measured one.
    assert md.count("no spread between seeds, so no interval") == 3
    assert "does not meet the rule (more than 1 point lower: no; lower in every seed: yes; pooled McNemar p < 0.05: no)" in md
    assert json.load(open(f"{res}/summary.json"))["control"] == "sigma0"


def test_accuracy_rule_needs_every_seed_and_reports_non_monotone():
    def acc(diffs, p):
        w = {"diff": float(np.mean(diffs))}
        return {"welch": w, "per_seed": [{"diff": d} for d in diffs], "pooled_mcnemar": {"p": p}}

    assert summarize.suffers(acc([-0.03, -0.02], 0.001))
    assert not summarize.suffers(acc([-0.05, +0.001], 0.001))  # not below the control in every seed
    assert not summarize.suffers(acc([-0.03, -0.02], 0.2))  # not significant per problem
    assert not summarize.suffers(acc([-0.005, -0.008], 0.001))  # within 1 point
    order = ["sigma1e-2", "sigma3e-2", "sigma1e-1"]
    mixed = {"sigma1e-2": acc([0.0, 0.0], 1.0), "sigma3e-2": acc([-0.03, -0.02], 0.001), "sigma1e-1": acc([-0.001, 0.0], 0.9)}
    got = summarize.accuracy_threshold(mixed, order)
    assert got["threshold"] is None and got["non_monotone"] == ["sigma3e-2"]
    none = summarize.accuracy_threshold({a: acc([0.0, 0.0], 1.0) for a in order}, order)
    assert none["threshold"] is None and none["text"] == "no sigma up to the largest lowered greedy accuracy by more than 1 point"
    near = {**{a: acc([0.0, 0.0], 1.0) for a in order}, "sigma1e-1": acc([-0.012, -0.011], 0.06)}
    got = summarize.accuracy_threshold(near, order)
    assert got["threshold"] is None
    assert got["text"].endswith(
        "by all three conditions (sigma1e-1: more than 1 point lower: yes; lower in every seed: yes; pooled McNemar p < 0.05: no)"
    )


def test_one_seed_reads_inconclusive_and_missing_control_is_refused(tmp_path):
    out = str(tmp_path / "out")
    _write(out, seeds=(0,), noise_kl=False)
    s = summarize.summarize(out, str(tmp_path / "res"))
    assert set(s["arms"]["sigma1e-1"]["readings"].values()) == {"inconclusive (one seed)"}
    # The synthetic sigma1e-1 loses 18 problems per seed: one seed must still not name a threshold.
    assert s["answer"]["accuracy"]["threshold"] is None and s["answer"]["exploration"].startswith("no verdict")
    assert "no verdict: fewer than two seeds" in open(str(tmp_path / "res" / "results.md")).read()
    assert s["arms"]["sigma1e-1"]["doses"] == [None, None, None]
    bare = str(tmp_path / "bare")
    _write(bare, effects={"sigma1e-2": EFFECTS["sigma1e-2"]}, noise_kl=False)
    with pytest.raises(SystemExit, match="no sigma0 run"):
        summarize.summarize(bare, str(tmp_path / "res2"))


def test_plan_projects_from_the_measured_steps(tmp_path, capsys):
    assert plan.project_minutes(6.0, 60.0, 180, 8, 4, 2, 2.0) == pytest.approx(1 + 179 * 6 / 60 + 2)
    assert plan.project_minutes(6.0, 60.0, 180, 8, 4, 1, 2.0) == pytest.approx(2 * (1 + 179 * 6 / 60 + 2))
    out = str(tmp_path / "out")
    _write(out, noise_kl=False)
    assert plan.main(["--out", out, "--steps", "40"]) == 0
    text = capsys.readouterr().out
    assert "sigma1e-1/seed0: 30 steps, first 6.0 s, then median 6.00 s" in text
    assert "until the slowest run is evaluated: 3.0 min" in text  # 10 steps x 6 s + 2 min
    assert plan.main(["--out", str(tmp_path / "empty")]) == 2
