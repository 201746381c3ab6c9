"""experiments/qwen_gsm8k: the summary's verdicts follow the numbers; the launcher's run configs."""

import argparse
import json
import os

import numpy as np
import pytest

from experiments import launcher
from experiments.qwen_gsm8k import summarize
from experiments.qwen_gsm8k.run import EXPERIMENT

STEPS = 40
ARMS = ("bf16_lr5e-6", "bf16", "nvfp4", "nvfp4_aqn", "bf16_aqn")


def _comparison(mean, half_width):
    return {"mean_diff": mean, "se": half_width / 1.96, "ci95": [mean - half_width, mean + half_width], "n_prompts": 64}


def _summary_file(path, gsm8k, n=1319):
    os.makedirs(path, exist_ok=True)
    datasets = {"gsm8k_test": {"pass_at_1": gsm8k, "num_examples": n}}
    datasets["math500_test"] = {"pass_at_1": gsm8k / 2, "num_examples": 480}
    json.dump({"datasets": datasets}, open(os.path.join(path, "summary.json"), "w"))


def _write(out, slopes, finals, seeds=3, steps_done=STEPS, entropy_diff=(0.2, 0.05), noise=0.01):
    """Synthetic runs: reward 0.3 + slope * step / 100 (+ noise); final accuracy per seed."""
    os.makedirs(out, exist_ok=True)
    json.dump({"steps": STEPS, "tiny": False, "gguf": "q.gguf", "sha256": "ab" * 32}, open(f"{out}/experiment.json", "w"))
    with open(f"{out}/calls.jsonl", "w") as f:
        f.write(json.dumps({"start": 0, "minutes": 7.5, "jobs": []}) + "\n")
        f.write(json.dumps({"base_from": "/x", "minutes": 2.5}) + "\n")
    open(f"{out}/commands.txt", "w").write("python -m experiments.qwen_gsm8k.run --out qg\n")
    rng = np.random.default_rng(0)
    for arm, slope in slopes.items():
        for seed in range(seeds):
            run = os.path.join(out, "runs", arm, f"seed{seed}")
            os.makedirs(f"{run}/tensorboard")
            with open(f"{run}/tensorboard/scalars.jsonl", "w") as f:
                for step in range(steps_done):
                    row = {
                        "step": step,
                        "aqn/sigma": 0.0,
                        "reward/mean_sampled": 0.3 + slope * step / 100 + rng.normal(0, noise),
                        "rollout/entropy_mc": 0.5,
                        "rollout/truncated_frac": 0.02,
                    }
                    f.write(json.dumps(row) + "\n")
            if steps_done == STEPS:
                _summary_file(f"{run}/eval/step_{STEPS}", finals[arm] + 0.01 * (seed - 1))
    for q, acc in (("bf16", 0.6), ("nvfp4", 0.55)):
        _summary_file(f"{out}/base/{q}", acc)
    mean, half = entropy_diff
    keys = (
        "nvfp4_minus_bf16_entropy",
        "nvfp4_minus_bf16_neg_logp",
        "nvfp4_minus_bf16_entropy_same_tokens",
        "nvfp4_aqn_minus_bf16_entropy",
    )
    models = {m: {"entropy": 1.0 + (mean if m != "bf16" else 0.0)} for m in ("bf16", "nvfp4", "nvfp4_aqn")}
    entropy = {"group_size": 4, "aqn_sigma": 0.01, "models": models, "comparisons": {k: _comparison(mean, half) for k in keys}}
    json.dump(entropy, open(f"{out}/base/entropy.json", "w"))


def _verdicts(s):
    return {k: c["verdict"] for k, c in s["claims"].items()}


def test_supported_verdicts_and_the_summary_schema(tmp_path):
    out, res = str(tmp_path / "out"), str(tmp_path / "res")
    slopes = {"bf16_lr5e-6": 0.1, "bf16": 0.2, "nvfp4": 0.3, "nvfp4_aqn": 0.6, "bf16_aqn": 0.2}
    finals = {"bf16_lr5e-6": 0.6, "bf16": 0.62, "nvfp4": 0.63, "nvfp4_aqn": 0.7, "bf16_aqn": 0.6}
    _write(out, slopes, finals)
    s = summarize.summarize(out, res)
    assert _verdicts(s) == {"a": "supported", "b": "supported", "c": "supported", "d": "supported"}
    assert set(s) >= {"model", "task", "arms", "claims", "gpu_minutes"}
    assert s["model"] == {"name": "Qwen2.5-Coder-1.5B-Instruct", "sha256": "ab" * 32, "gguf": "q.gguf", "base": summarize.BASE_NOTE}
    assert s["task"] == "gsm8k" and s["gpu_minutes"] == pytest.approx(10.0)
    arm = s["arms"]["nvfp4_aqn"]
    assert (arm["quant"], arm["lr"], arm["aqn"], arm["seeds"], arm["steps"]) == ("nvfp4", 1e-5, True, [0, 1, 2], STEPS)
    assert arm["eval_before"] == {"gsm8k_test": 0.55, "n": 1319}
    np.testing.assert_allclose(arm["eval_after"]["gsm8k_test"], [0.69, 0.70, 0.71])
    assert arm["eval_after"]["n"] == 1319
    np.testing.assert_allclose(arm["reward_slope_per_100"], 0.6, atol=0.05)  # noise sd 0.014
    assert arm["truncated_frac"] == pytest.approx(0.02)
    assert s["arms"]["bf16"]["eval_before"]["gsm8k_test"] == 0.6
    assert set(s["claims"]["b"]["parts"]) == {"nvfp4_vs_bf16", "nvfp4_vs_bf16_lr5e-6"}
    assert s["protocol"].startswith("PROTOCOL.md, rule v3") and s["margins"] == {"b": 0.01, "c": 0.01, "d": 0.01}
    assert set(s["claims_by_rule"]) == {"v1", "v2"} and set(s["claims_by_rule"]["v1"]) == {"b", "c", "d"}
    assert arm["greedy_headroom_gain"] == pytest.approx([(x - 0.55) / 0.45 for x in (0.69, 0.70, 0.71)])
    assert arm["eval_after"]["per_problem_kept"] == [False, False, False]
    part = s["claims"]["b"]["parts"]["nvfp4_vs_bf16"]
    assert part["slope"]["n"] == 3 and part["slope"]["lo"] > -0.01 and "Headroom-normalised" in part["text"]
    on_disk = json.load(open(f"{res}/summary.json"))
    assert on_disk["arms"].keys() == set(ARMS)
    for name in ("qwen_gsm8k.png", "results.md", "curves.json"):
        assert os.path.isfile(f"{res}/{name}")
    md = open(f"{res}/results.md").read()
    assert "python -m experiments.qwen_gsm8k.run --out qg" in md
    first = md.split("\n")[2]  # the limits come first: model, base, steps
    assert "Qwen2.5-Coder-1.5B-Instruct" in first and "Q4_K_M file dequantized to bf16" in first and f"{STEPS} steps" in first
    assert "round-to-nearest" in first and "± 0.000 " not in md


# reward 0.3 + slope * step / 100: first 10% (steps 0..3) mean 0.3 + 1.5 slope / 100, last 20% (32..39) 0.3 + 35.5 slope / 100
def test_growth_measures_against_numpy():
    r = 0.3 + 0.5 * np.arange(STEPS) / 100
    g = summarize.growth(r, threshold=0.4, window=1)
    assert g["slope_per_100"] == pytest.approx(0.5)
    assert g["relative_growth"] == pytest.approx((0.3 + 0.5 * 35.5 / 100) / (0.3 + 0.5 * 1.5 / 100) - 1)
    assert g["steps_to_threshold"] == 20  # 0.3 + 0.005 * 20 = 0.4
    assert summarize.growth(r, threshold=2.0, window=1)["steps_to_threshold"] is None


@pytest.mark.parametrize(
    "slopes,finals,entropy_diff,want",
    [
        (  # NVFP4 slower and worse, AQN slower still, lower entropy
            {"bf16_lr5e-6": 0.4, "bf16": 0.4, "nvfp4": -0.3, "nvfp4_aqn": -0.9},
            {"bf16_lr5e-6": 0.7, "bf16": 0.7, "nvfp4": 0.6, "nvfp4_aqn": 0.6},
            (-0.2, 0.05),
            {"a": "not supported", "b": "not supported", "c": "not supported", "d": "not supported"},
        ),
        (  # b: faster than bf16 at equal lr but much slower than the reference's bf16 -> not supported overall;
            # c: AQN exactly as fast (its interval holds 0)
            {"bf16_lr5e-6": 1.5, "bf16": -0.2, "nvfp4": 0.5, "nvfp4_aqn": 0.5},
            {"bf16_lr5e-6": 0.6, "bf16": 0.6, "nvfp4": 0.6, "nvfp4_aqn": 0.6},
            (0.005, 0.01),
            {"a": "not supported", "b": "not supported", "c": "inconclusive"},
        ),
        (  # nothing clearly separated: within 2 SE
            {"bf16_lr5e-6": 0.3, "bf16": 0.3, "nvfp4": 0.26, "nvfp4_aqn": 0.32},
            {"bf16_lr5e-6": 0.6, "bf16": 0.6, "nvfp4": 0.6, "nvfp4_aqn": 0.595},
            (0.1, 0.3),
            {"a": "inconclusive", "b": "inconclusive", "c": "inconclusive", "d": "inconclusive"},
        ),
    ],
    ids=["all_negative", "mixed_b", "within_noise"],
)
def test_negative_and_inconclusive_verdicts(tmp_path, slopes, finals, entropy_diff, want):
    out = str(tmp_path / "out")
    _write(out, slopes, finals, entropy_diff=entropy_diff, noise=0.05)
    s = summarize.summarize(out, str(tmp_path / "res"))
    assert {k: s["claims"][k]["verdict"] for k in want} == want
    if slopes["bf16"] < slopes["nvfp4"] < slopes["bf16_lr5e-6"]:  # the mixed case: each part's own verdict
        parts = s["claims"]["b"]["parts"]
        assert parts["nvfp4_vs_bf16"]["verdict"] == "supported"
        assert parts["nvfp4_vs_bf16_lr5e-6"]["verdict"] == "not supported"


def test_one_seed_is_inconclusive_and_incomplete_runs_use_common_steps(tmp_path):
    out = str(tmp_path / "out")
    _write(out, {"bf16": 0.1, "nvfp4": 0.9, "nvfp4_aqn": 0.9}, {}, seeds=1, steps_done=25)
    s = summarize.summarize(out, str(tmp_path / "res"))
    assert s["common_steps"] == 25 and s["arms"]["nvfp4"]["steps"] == 25
    for claim in ("b", "c", "d"):
        assert s["claims"][claim]["verdict"] == "inconclusive"
    assert s["claims"]["b"]["parts"]["nvfp4_vs_bf16"]["reason"] == "one seed"
    assert s["arms"]["nvfp4"]["eval_after"] == {
        "gsm8k_test": [None],
        "n": None,
        "math500_test": [None],
        "per_problem_kept": [False],
    }
    assert "(25/40, 0 evaluated)" in open(tmp_path / "res" / "results.md").read()


def test_run_config_sets_only_path_seed_workdir_steps_and_cache(tmp_path):
    from configs import gsm8k_claims

    args = argparse.Namespace(gguf="/m/q.gguf", out=str(tmp_path), steps=150, tiny=False)
    for arm in ARMS:
        cfg = launcher.run_config(EXPERIMENT, args, arm, 2)
        ref = gsm8k_claims.get_config(arm)
        assert (cfg.model.path, cfg.seed, cfg.resume) == ("/m/q.gguf", 2, False)
        assert cfg.workdir == os.path.join(str(tmp_path), "runs", arm, "seed2")
        os.makedirs(os.path.join(cfg.workdir, "checkpoints"))
        assert launcher.run_config(EXPERIMENT, args, arm, 2).resume  # a begun run continues
        # the experiment's processes share one compilation cache in its directory
        assert cfg.compile_cache_dir == os.path.join(str(tmp_path), "jax_cache")
        for field in ("model.path", "seed", "workdir", "resume", "compile_cache_dir"):
            section, _, name = field.rpartition(".")
            (ref[section] if section else ref)[name] = (cfg[section] if section else cfg)[name]
        assert cfg.to_dict() == ref.to_dict()  # everything else is the arm's config
    ev = launcher.final_eval_config(EXPERIMENT, args, "nvfp4_aqn", 1)
    assert ev.eval.checkpoint == os.path.join(str(tmp_path), "runs", "nvfp4_aqn", "seed1")
    assert ev.eval.output_dir.endswith(os.path.join("seed1", "eval", "step_150"))
    assert [os.path.relpath(p, os.path.dirname(os.path.dirname(p))) for p in ev.eval.datasets] == [
        os.path.join("gsm8k", "test.jsonl"),
        os.path.join("math500", "test.jsonl"),
    ]
    assert all(os.path.isfile(p) for p in ev.eval.datasets)


def test_bad_input_exits_2_before_writing(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        launcher.main(EXPERIMENT, "", ["--gguf", str(gguf), "--out", str(out), "--base-from", str(tmp_path / "no")])
    assert e.value.code == 2 and "--base-from" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit) as e:
        launcher.main(EXPERIMENT, "", ["--gguf", str(gguf), "--out", str(out), "--parallel", "-1"])
    assert e.value.code == 2 and "--parallel -1" in capsys.readouterr().err
    assert not out.exists()
    for bad in ("bf16", "fp8:0", "nvfp4:x"):
        with pytest.raises(SystemExit) as e:
            launcher.main(EXPERIMENT, "", ["--gguf", str(gguf), "--out", str(out), "--runs", "nvfp4:2", bad])
        assert e.value.code == 2 and f"--runs {bad}: expected ARM:SEED" in capsys.readouterr().err
        assert not out.exists()


def test_runs_name_exactly_the_runs_else_every_arm_and_seed():
    args = launcher.parser(EXPERIMENT, "").parse_args(["--out", "o", "--arms", "bf16", "nvfp4", "--seeds", "0", "1"])
    assert launcher.train_runs(EXPERIMENT, args) == [("bf16", 0), ("bf16", 1), ("nvfp4", 0), ("nvfp4", 1)]
    args.runs = ["nvfp4_aqn:2", "bf16_lr5e-6:0", "nvfp4_aqn:2"]
    assert launcher.train_runs(EXPERIMENT, args) == [("nvfp4_aqn", 2), ("bf16_lr5e-6", 0)]


def test_paired_differences_against_numpy():
    # two seeds; the arms share step prompts, so a per-step offset common to both arms cancels
    steps = np.arange(12)
    common = np.sin(steps)  # the step's prompt difficulty
    curves = lambda r: {"curves": {"reward": r}}  # noqa: E731
    runs = {
        "bf16": {0: curves(0.5 + common), 1: curves(0.4 + common[:10])},
        "nvfp4": {0: curves(0.45 + common + 0.002 * steps), 1: curves(0.38 + common[:10] + 0.004 * steps[:10])},
    }
    p = summarize.paired(runs, "nvfp4", "bf16")
    assert p["seeds"] == [0, 1] and p["steps_per_seed"] == [12, 10]
    np.testing.assert_allclose(p["slope_per_seed"], [0.2, 0.4], atol=1e-9)
    np.testing.assert_allclose(p["level_per_seed"], [-0.05 + 0.002 * 5.5, -0.02 + 0.004 * 4.5], atol=1e-9)
    assert p["slope_per_100"] == pytest.approx(0.3) and p["slope_se"] == pytest.approx(np.std([0.2, 0.4], ddof=1) / np.sqrt(2))
    verdict = summarize.judge_paired("nvfp4", "bf16", p, what="reward")
    # t(1) = 12.706: 0.3 +- 12.706 * 0.1 holds 0
    assert verdict["verdict"] == "inconclusive" and "-0.971 .. +1.571" in verdict["text"]
    one = summarize.judge_paired("nvfp4", "bf16", summarize.paired({k: {0: v[0]} for k, v in runs.items()}, "nvfp4", "bf16"), what="reward")
    assert one["verdict"] == "inconclusive" and one["reason"] == "one seed"


def test_runs_of_a_format_start_after_its_first_run():
    jobs = [("base", None, None)] + [("train", arm, seed) for arm in ("bf16", "nvfp4", "nvfp4_aqn", "bf16_aqn") for seed in (0, 1)]
    leaders, followers = launcher.staggered(EXPERIMENT, jobs)
    assert leaders == [("base", None, None), ("train", "bf16", 0), ("train", "nvfp4", 0)]
    assert followers == {
        ("train", "bf16", 1): ("train", "bf16", 0),
        ("train", "nvfp4", 1): ("train", "nvfp4", 0),
        ("train", "nvfp4_aqn", 0): ("train", "nvfp4", 0),
        ("train", "nvfp4_aqn", 1): ("train", "nvfp4", 0),
        ("train", "bf16_aqn", 0): ("train", "bf16", 0),
        ("train", "bf16_aqn", 1): ("train", "bf16", 0),
    }


def test_the_queue_starts_begun_runs_first_and_fills_free_slots_only():
    jobs = [("train", arm, seed) for arm in ("bf16", "nvfp4") for seed in (0, 1, 2)]
    progress = {("train", "bf16", 1): 133, ("train", "nvfp4", 0): 132, ("train", "nvfp4", 1): 99}
    order = launcher.queue_order(jobs, progress)
    assert order == [
        ("train", "bf16", 1),
        ("train", "nvfp4", 0),
        ("train", "nvfp4", 1),
        ("train", "bf16", 0),
        ("train", "bf16", 2),
        ("train", "nvfp4", 2),
    ]
    fresh = [("train", arm, seed) for arm in ("bf16", "bf16_lr5e-6") for seed in (0, 1, 2)]
    done = {("train", "bf16", 0), ("train", "bf16", 1)}
    assert launcher.queue_order([j for j in fresh if j not in done], {}) == [
        ("train", "bf16_lr5e-6", 0),
        ("train", "bf16_lr5e-6", 1),
        ("train", "bf16", 2),
        ("train", "bf16_lr5e-6", 2),
    ]
    assert launcher.queue_order([("train", "bf16", 0), ("base", None, None)], {})[0] == ("base", None, None)
    _, waits_for = launcher.staggered(EXPERIMENT, order)
    leaders = {("train", "bf16", 1), ("train", "nvfp4", 0)}
    assert set(waits_for.values()) == leaders
    nothing_compiled = lambda job: False  # noqa: E731
    # 4 slots, none running: only the two leaders may start before they have compiled
    assert launcher.to_launch(order, waits_for, 0, 4, nothing_compiled) == [("train", "bf16", 1), ("train", "nvfp4", 0)]
    pending = order[2:]
    all_compiled = lambda job: True  # noqa: E731
    assert launcher.to_launch(pending, waits_for, 2, 4, all_compiled) == pending[:2]  # two free slots
    assert launcher.to_launch(pending, waits_for, 4, 4, all_compiled) == []
    only_bf16 = lambda job: job[1] == "bf16"  # noqa: E731
    assert launcher.to_launch(pending, waits_for, 2, 4, only_bf16) == [("train", "bf16", 0), ("train", "bf16", 2)]


def test_runs_that_only_evaluate_neither_wait_nor_hold_back():
    jobs = [("train", "nvfp4", 1), ("train", "nvfp4_aqn", 0), ("train", "nvfp4_aqn", 1), ("train", "nvfp4", 2)]
    progress = {("train", "nvfp4", 1): 150, ("train", "nvfp4_aqn", 0): 150, ("train", "nvfp4_aqn", 1): 120}
    waits_for = launcher.waits_for_compile(EXPERIMENT, jobs, progress, steps=150)
    # nvfp4_aqn seed 1 leads its format now; the finished runs start at once
    assert waits_for == {("train", "nvfp4", 2): ("train", "nvfp4_aqn", 1)}
    assert launcher.to_launch(jobs, waits_for, 0, 4, lambda job: False) == jobs[:3]


def _runs(diffs_by_seed, key="reward"):
    """Two arms whose per-step difference (b - a) for each seed is the given array; a shared
    per-step offset (the prompts' difficulty) cancels."""
    curves = lambda r: {"curves": {key: r}}  # noqa: E731
    runs = {"a": {}, "b": {}}
    for seed, d in enumerate(diffs_by_seed):
        common = 0.5 + 0.1 * np.sin(np.arange(len(d)))
        runs["a"][seed], runs["b"][seed] = curves(common), curves(common + d)
    return runs


def test_rule_v3_counts_within_run_noise_that_rule_v2_ignores():
    """Three seeds with the same slope difference (+0.002 per 100 steps) but noisy steps: v2's
    interval (between-seed spread only) excludes 0; v3's floor at the runs' own error does not."""
    rng = np.random.default_rng(3)
    steps = np.arange(150)
    diffs = []
    for _ in range(3):
        noise = rng.normal(0, 0.03, 150)
        noise -= np.polyfit(steps, noise, 1)[0] * (steps - steps.mean())  # each seed's OLS slope is exactly 0.002
        diffs.append(0.00002 * steps + noise)
    p = summarize.paired(_runs(diffs), "b", "a")
    np.testing.assert_allclose(p["slope_per_seed"], 0.002, atol=1e-9)
    assert summarize.judge_paired("b", "a", p, what="reward")["verdict"] == "supported"  # v2
    v3 = summarize.judge_growth("b", "a", p, claim="c")
    assert v3["verdict"] == "inconclusive" and v3["slope"]["lo"] < 0 < v3["slope"]["hi"]
    assert v3["slope"]["se"] == pytest.approx(v3["slope"]["se_within"])
    assert v3["slope"]["se_within"] > 10 * v3["slope"]["se_between"]


def test_rule_v3_asks_non_inferiority_for_b_and_equivalence_for_c():
    steps = np.arange(150)
    # NVFP4 a little slower (-0.003 per 100 steps) in every seed, with almost no noise
    slower = [-0.00003 * steps + 1e-4 * np.cos(steps * (1 + s)) for s in range(3)]
    p = summarize.paired(_runs(slower), "b", "a")
    b = summarize.judge_growth("b", "a", p, claim="b")
    assert b["verdict"] == "supported" and -0.01 < b["slope"]["lo"] < b["slope"]["hi"] < 0  # non-inferior, not faster
    assert summarize.judge_paired("b", "a", p, what="reward")["verdict"] == "not supported"  # v2 asked "faster"
    much_slower = [-0.0003 * steps + 1e-4 * np.cos(steps * (1 + s)) for s in range(3)]
    assert summarize.judge_growth("b", "a", summarize.paired(_runs(much_slower), "b", "a"), claim="b")["verdict"] == "not supported"
    same = [1e-4 * np.cos(steps * (1 + s)) for s in range(3)]
    c = summarize.judge_growth("b", "a", summarize.paired(_runs(same), "b", "a"), claim="c")
    assert c["verdict"] == "not supported" and c["reading"] == "equivalent within ±0.01"
    faster = [0.0003 * steps + 1e-4 * np.cos(steps * (1 + s)) for s in range(3)]
    assert summarize.judge_growth("b", "a", summarize.paired(_runs(faster), "b", "a"), claim="c")["verdict"] == "supported"
    one = summarize.judge_growth("b", "a", summarize.paired(_runs(same[:1]), "b", "a"), claim="b")
    assert one["verdict"] == "inconclusive" and one["reason"] == "one seed"


def test_rule_v3_accuracy_uses_welch_t_where_v1_used_2_se():
    bf16, qerl = [0.675, 0.670, 0.680], [0.661, 0.660, 0.658]  # difference -0.0153, SE 0.003
    assert summarize.verdict_v1(bf16, qerl, strict=False) == "not supported"  # below -2 SE
    d = summarize.judge_accuracy("bf16", bf16, "qerl", qerl, paired_test=None)
    assert d["welch"]["df"] == pytest.approx(2.37, abs=0.01)
    assert d["verdict"] == "inconclusive" and d["welch"]["lo"] < -0.01 < d["welch"]["hi"]
    assert "per-problem outputs not kept" in d["text"]
    worse = summarize.judge_accuracy("bf16", bf16, "qerl", [0.64, 0.641, 0.639], paired_test=None)
    assert worse["verdict"] == "not supported"
    assert summarize.verdict_v1([0.05, 0.06], [0.05, 0.062], strict=True) == "inconclusive"
    assert summarize.verdict_v1([0.05, 0.06], [0.049, 0.058], strict=True) == "not supported"


def test_mcnemar_from_kept_per_problem_outputs(tmp_path):
    import gzip

    out = str(tmp_path / "out")
    finals = {"bf16_lr5e-6": 0.6, "bf16": 0.6, "nvfp4": 0.6, "nvfp4_aqn": 0.6}
    _write(out, {a: 0.2 for a in finals}, finals, seeds=2)
    # per seed: problems 2 and 3 only nvfp4_aqn solved, problem 1 only bf16
    correct = {"bf16": [1, 1, 0, 0, 1], "nvfp4_aqn": [1, 0, 1, 1, 1]}
    for arm, flags in correct.items():
        for seed in (0, 1):
            path = os.path.join(out, "runs", arm, f"seed{seed}", "eval", f"step_{STEPS}", summarize.PROBLEMS_FILE)
            with gzip.open(path, "wt") as f:
                for i, ok in enumerate(flags):
                    f.write(json.dumps({"metric": "pass_at_1", "id": f"gsm8k/test/{i}", "correct": bool(ok), "length": 9}) + "\n")
                f.write(json.dumps({"metric": "mean_at_2", "id": "gsm8k/test/0", "correct": False, "length": 9}) + "\n")
    s = summarize.summarize(out, str(tmp_path / "res"))
    part = s["claims"]["d"]["parts"]["nvfp4_aqn_vs_bf16"]
    assert part["mcnemar"] == {"seeds": [0, 1], "b_only": 4, "a_only": 2, "p": pytest.approx(2 * (1 + 6 + 15) / 64)}
    assert "4 problems only nvfp4_aqn solved, 2 only bf16" in part["text"]
    assert s["claims"]["d"]["parts"]["nvfp4_aqn_vs_bf16_lr5e-6"]["mcnemar"] is None
    assert s["arms"]["bf16"]["eval_after"]["per_problem_kept"] == [True, True]


def test_headroom_gain_and_small_spreads_print_digits():
    r = np.concatenate([np.full(10, 0.5), np.full(70, 0.6), np.full(20, 0.75)])
    assert summarize.growth(r, threshold=2.0, window=1)["headroom_gain"] == pytest.approx((0.75 - 0.5) / 0.5)
    assert summarize._spread(0.0004, 3) == "0.0004" and summarize._spread(0.0123, 3) == "0.012"
    assert summarize._spread(0.0, 3) == "0"


def test_results_name_the_bases_math500_when_measured(tmp_path):
    assert summarize._base_math500_text(str(tmp_path)) == "No MATH500 was measured before training."
    for quant, score in (("bf16", 0.40461), ("nvfp4", 0.34172)):
        os.makedirs(tmp_path / "base_math500" / quant)
        (tmp_path / "base_math500" / quant / "summary.json").write_text(
            json.dumps({"metrics": {"math500_test/pass_at_1": score}})
        )
    text = summarize._base_math500_text(str(tmp_path))
    assert "bf16 40.5%" in text and "nvfp4 34.2%" in text
