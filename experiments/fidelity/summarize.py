"""The fidelity experiment's summary: curves (PNG), table and claims (markdown), numbers (JSON).

  python -m experiments.fidelity.run --summarize --out runs/fidelity --results experiments/fidelity/results

Reads <out>/experiment.json, <out>/base/{entropy.json, bf16/summary.json, nvfp4/summary.json} and
every <out>/runs/<arm>/seed<k>/ (tensorboard/scalars.jsonl, eval/step_<steps>/summary.json);
writes <results>/fidelity.png, results.md, summary.json and curves.json (the per-step scalars
the notebook plots). Runs may be incomplete: every comparison uses the steps all its runs reached.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

ARMS = ("bf16", "nvfp4", "nvfp4_aqn", "nvfp4_aqn_current")
ARM_LABELS = {
    "bf16": "bf16 LoRA",
    "nvfp4": "NVFP4 LoRA",
    "nvfp4_aqn": "NVFP4 LoRA + AQN",
    "nvfp4_aqn_current": "NVFP4 LoRA + AQN, ratio vs train forward",
}
TAGS = {
    "reward": "reward/mean_sampled",
    "accuracy": "reward/accuracy_sampled",
    "entropy_sampler": "rollout/entropy_mc",
    "entropy_train": "train/entropy",
    "response_length": "rollout/response_length_mean",
    "truncated": "rollout/truncated_frac",
    "aqn_sigma": "aqn/sigma",
    "clip_frac": "train/clip_frac",
    "sampler_clip_frac": "train/sampler_clip_frac",
    "abs_log_ratio": "train/sampler_abs_log_ratio",
}
NEGLIGIBLE_CLIP_FRAC = 1e-3
SAME_ENTROPY_REL = 0.02  # claim (a): a 95% interval within +-2% of bf16's entropy means "no difference"


# ----------------------------------------------------------------------------- reading


def _jsonl_curves(path: str, tags: dict[str, str] = TAGS) -> dict[str, np.ndarray]:
    """key -> values by step of each scalar tag (NaN where missing); a resumed run's repeated steps: the last wins."""
    rows: dict[int, dict] = {}
    for line in open(path):
        if line.strip():
            row = json.loads(line)
            if "aqn/sigma" in row:  # a train step (evaluations log eval/* only)
                rows[row["step"]] = row
    n = max(rows) + 1 if rows else 0
    out = {}
    for key, tag in tags.items():
        out[key] = np.array([rows.get(s, {}).get(tag, np.nan) for s in range(n)], np.float64)
    return out


def _pass_at_1(summary_file: str) -> float | None:
    if not os.path.isfile(summary_file):
        return None
    datasets = json.load(open(summary_file))["datasets"]
    return float(next(iter(datasets.values()))["pass_at_1"]) if datasets else None


def load_runs(out: str, steps: int) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for arm in ARMS:
        arm_dir = os.path.join(out, "runs", arm)
        if not os.path.isdir(arm_dir):
            continue
        for name in sorted(os.listdir(arm_dir)):
            jsonl = os.path.join(arm_dir, name, "tensorboard", "scalars.jsonl")
            if not name.startswith("seed") or not os.path.isfile(jsonl):
                continue
            curves = _jsonl_curves(jsonl)
            runs.setdefault(arm, {})[int(name[4:])] = {
                "curves": curves,
                "steps": len(curves["reward"]),
                "greedy_after": _pass_at_1(os.path.join(arm_dir, name, "eval", f"step_{steps}", "summary.json")),
            }
    return runs


# ----------------------------------------------------------------------------- statistics


def _windows(n: int) -> tuple[slice, slice]:
    """The first 10% and the last 20% of n steps (at least one step each)."""
    return slice(0, max(1, n // 10)), slice(n - max(1, n // 5), n)


def run_stats(curves: dict[str, np.ndarray], n: int) -> dict[str, float]:
    """Per-run numbers over its first n steps: reward growth (slope, delta), windows, means."""
    first, last = _windows(n)
    r = curves["reward"][:n]
    ok = np.isfinite(r)
    slope = float(np.polyfit(np.arange(n)[ok], r[ok], 1)[0] * 100) if ok.sum() > 1 else float("nan")
    mean = lambda key, sl=slice(0, n): (
        float(np.nanmean(curves[key][sl])) if np.isfinite(curves[key][sl]).any() else float("nan")
    )  # noqa: E731
    return {
        "reward_slope_per_100": slope,
        "reward_first": mean("reward", first),
        "reward_last": mean("reward", last),
        "reward_delta": mean("reward", last) - mean("reward", first),
        "reward_mean": mean("reward"),
        "entropy_sampler_first": mean("entropy_sampler", first),
        "entropy_sampler_last": mean("entropy_sampler", last),
        "entropy_train_mean": mean("entropy_train"),
        "response_length_first": mean("response_length", first),
        "response_length_last": mean("response_length", last),
        "clip_frac": mean("clip_frac"),
        "sampler_clip_frac": mean("sampler_clip_frac"),
        "abs_log_ratio": mean("abs_log_ratio"),
        "aqn_sigma_max": float(np.nanmax(curves["aqn_sigma"][:n])) if n else float("nan"),
    }


def _mean_std(values) -> tuple[float, float]:
    v = np.array([x for x in values if x is not None and math.isfinite(x)], np.float64)
    if not len(v):
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def compare(a: list[float], b: list[float]) -> dict[str, float]:
    """mean(b) - mean(a) over seeds and its standard error (Welch)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    var = lambda x: x.var(ddof=1) / len(x) if len(x) > 1 else float("nan")  # noqa: E731
    return {"diff": float(b.mean() - a.mean()), "se": float(math.sqrt(var(a) + var(b))), "n_a": len(a), "n_b": len(b)}


def _fmt(mean: float, std: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


# ----------------------------------------------------------------------------- claims


def claim_a(entropy: dict | None) -> dict:
    if entropy is None:
        return {"verdict": "not measured", "text": "the base stage did not finish (no base/entropy.json)"}
    c = entropy["comparisons"]["nvfp4_minus_bf16_entropy"]
    h = entropy["models"]["bf16"]["entropy"]
    lo, hi = c["ci95"]
    if lo > 0:
        verdict = "supported"
    elif hi < 0:
        verdict = "not supported"
    elif max(abs(lo), abs(hi)) < SAME_ENTROPY_REL * h:
        verdict = "not supported"
    else:
        verdict = "inconclusive"
    same = entropy["comparisons"]["nvfp4_minus_bf16_entropy_same_tokens"]
    mc = entropy["comparisons"]["nvfp4_minus_bf16_neg_logp"]
    aqn = entropy["comparisons"]["nvfp4_aqn_minus_bf16_entropy"]
    text = (
        f"per-token entropy of samples from the untrained policy ({c['n_prompts']} prompts x "
        f"{entropy['group_size']} samples, same keys): bf16 {h:.4f}, NVFP4 {entropy['models']['nvfp4']['entropy']:.4f} "
        f"nats; NVFP4 - bf16 = {c['mean_diff']:+.4f} (95% CI {lo:+.4f} .. {hi:+.4f}, {100 * c['mean_diff'] / h:+.1f}%). "
        f"On the same (bf16-sampled) tokens: {same['mean_diff']:+.4f} (CI {same['ci95'][0]:+.4f} .. {same['ci95'][1]:+.4f}); "
        f"Monte Carlo -log p of the sampled tokens: {mc['mean_diff']:+.4f} (CI {mc['ci95'][0]:+.4f} .. {mc['ci95'][1]:+.4f}); "
        f"NVFP4 + AQN noise at sigma={entropy.get('aqn_sigma', float('nan')):g}: {aqn['mean_diff']:+.4f} "
        f"(CI {aqn['ci95'][0]:+.4f} .. {aqn['ci95'][1]:+.4f})."
    )
    return {"verdict": verdict, "text": text, "numbers": entropy["comparisons"]}


def _growth_claim(name_a: str, a: list[float], name_b: str, b: list[float], *, at_least: bool) -> dict:
    """b's reward slope against a's: at_least (b >= a, claim b) or strictly more (claim c)."""
    if len(a) < 2 or len(b) < 2:
        return {
            "verdict": "inconclusive",
            "text": f"fewer than 2 seeds with scalars ({name_a}: {len(a)}, {name_b}: {len(b)})",
        }
    c = compare(a, b)
    diff, se = c["diff"], c["se"]
    ma, sa = _mean_std(a)
    mb, sb = _mean_std(b)
    numbers = (
        f"reward slope per 100 steps (mean ± std over seeds): {name_b} {mb:+.4f} ± {sb:.4f}, {name_a} {ma:+.4f} ± {sa:.4f}; "
        f"difference {diff:+.4f} (standard error {se:.4f})"
    )
    grew = [m > 2 * sd / math.sqrt(len(x)) for (m, sd), x in (((ma, sa), a), ((mb, sb), b))]
    if not any(grew):
        return {
            "verdict": "inconclusive",
            "text": numbers + "; the reward did not grow in either arm",
            "diff": diff,
            "se": se,
        }
    if at_least:
        verdict = "supported" if diff >= 0 else ("not supported" if diff < -2 * se else "inconclusive")
    else:
        verdict = "supported" if diff > 2 * se else ("not supported" if diff <= 0 else "inconclusive")
    return {"verdict": verdict, "text": numbers, "diff": diff, "se": se}


# ----------------------------------------------------------------------------- output


def _smooth(x: np.ndarray, w: int) -> np.ndarray:
    """Trailing moving average over the last w steps (fewer at the start), ignoring NaNs."""
    valid = np.isfinite(x)
    num = np.cumsum(np.where(valid, x, 0.0))
    den = np.cumsum(valid.astype(float))
    shift = lambda c: np.concatenate([np.zeros(min(w, len(c))), c[:-w]]) if w < len(c) else np.zeros(len(c))  # noqa: E731
    n, d = num - shift(num), den - shift(den)
    return np.where(d > 0, n / np.maximum(d, 1), np.nan)


def plot(curves_by_arm: dict[str, list[dict]], path: str, n_common: int) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    w = max(1, n_common // 20)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, label in (
        (axes[0], "reward", "reward (accuracy of all sampled rollouts)"),
        (axes[1], "entropy_sampler", "entropy of the sampled tokens (nats, -log p)"),
    ):
        for arm, runs in curves_by_arm.items():
            n = min(len(r[key]) for r in runs)
            ys = np.stack([_smooth(r[key][:n], w) for r in runs])
            if not np.isfinite(ys).any():
                continue
            mean, std = ys.mean(0), ys.std(0)
            steps = np.arange(n)
            ax.plot(steps, mean, label=f"{ARM_LABELS[arm]} ({len(runs)} seeds)")
            ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, arithmetic, DAPO + LoRA: mean ± std over seeds (moving average of {w} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_experiment(out: str, results: str, load_runs) -> tuple[dict, dict, dict | None]:
    """(experiment.json, its runs by `load_runs(out, steps)`, base/entropy.json or None) of an
    experiment directory; creates `results`. SystemExit when no run has scalars."""
    exp = json.load(open(os.path.join(out, "experiment.json")))
    runs = load_runs(out, exp["steps"])
    if not runs:
        raise SystemExit(f"{out}/runs holds no run with scalars.jsonl: nothing to summarize")
    os.makedirs(results, exist_ok=True)
    entropy_file = os.path.join(out, "base", "entropy.json")
    entropy = json.load(open(entropy_file)) if os.path.isfile(entropy_file) else None
    return exp, runs, entropy


def summarize(out: str, results: str) -> dict:
    exp, runs, entropy = read_experiment(out, results, load_runs)
    steps = exp["steps"]
    before = {q: _pass_at_1(os.path.join(out, "base", q, "summary.json")) for q in ("bf16", "nvfp4")}
    n_common = min(r["steps"] for arm_runs in runs.values() for r in arm_runs.values())

    per_run = {
        arm: {seed: run_stats(r["curves"], n_common) for seed, r in arm_runs.items()} for arm, arm_runs in runs.items()
    }
    slopes = {arm: [s["reward_slope_per_100"] for s in per_run[arm].values()] for arm in per_run}
    claims = {"a": claim_a(entropy)}
    if "bf16" in slopes and "nvfp4" in slopes:
        claims["b"] = _growth_claim("bf16", slopes["bf16"], "NVFP4", slopes["nvfp4"], at_least=True)
    if "nvfp4" in slopes and "nvfp4_aqn" in slopes:
        claims["c"] = _growth_claim("NVFP4", slopes["nvfp4"], "NVFP4 + AQN", slopes["nvfp4_aqn"], at_least=False)
    ratio = {}
    for arm in ("nvfp4_aqn", "nvfp4_aqn_current"):
        if arm in slopes and "bf16" in slopes:
            ratio[arm] = _growth_claim("bf16", slopes["bf16"], ARM_LABELS[arm], slopes[arm], at_least=True)
    aqn_clip = _mean_std([s["sampler_clip_frac"] for s in per_run.get("nvfp4_aqn", {}).values()])[0]
    if len(ratio) == 2:
        same = ratio["nvfp4_aqn"]["verdict"] == ratio["nvfp4_aqn_current"]["verdict"]
        claims["ratio_source"] = {
            "verdict": "does not change (b)" if same else "changes (b)",
            "text": (
                f"NVFP4 + AQN sampler vs train forward: clip fraction {aqn_clip:.4f} "
                f"({'negligible' if aqn_clip < NEGLIGIBLE_CLIP_FRAC else 'not negligible'}, threshold {NEGLIGIBLE_CLIP_FRAC}). "
                f"(b) with the sampler's log-probs in the ratio: {ratio['nvfp4_aqn']['verdict']} "
                f"({ratio['nvfp4_aqn']['text']}); with the train forward's: {ratio['nvfp4_aqn_current']['verdict']} "
                f"({ratio['nvfp4_aqn_current']['text']})."
            ),
        }

    table = [
        "| arm | seeds (steps) | reward, first 10% → last 20% of steps | reward slope / 100 steps "
        "| greedy test accuracy, before → after | sampled-token entropy, first → last | response length, first → last "
        "| clip fraction | clip fraction vs sampler | mean abs log ratio train vs sampler | max AQN sigma |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    arm_summary = {}
    for arm in ARMS:
        if arm not in per_run:
            continue
        stats = list(per_run[arm].values())
        ms = lambda k, stats=stats: _mean_std([s[k] for s in stats])  # noqa: E731
        after = _mean_std([r["greedy_after"] for r in runs[arm].values()])
        base = before["bf16" if arm == "bf16" else "nvfp4"]
        arm_summary[arm] = {k: ms(k) for k in stats[0]}
        arm_summary[arm].update(greedy_before=base, greedy_after=after, seeds=sorted(runs[arm]))
        done = sum(r["greedy_after"] is not None for r in runs[arm].values())
        table.append(
            f"| {ARM_LABELS[arm]} | {len(stats)} ({n_common}/{steps}{'' if done == len(stats) else f', {done} evaluated'}) "
            f"| {_fmt(*ms('reward_first'))} → {_fmt(*ms('reward_last'))} | {_fmt(*ms('reward_slope_per_100'), 4)} "
            f"| {'n/a' if base is None else f'{base:.3f}'} → {_fmt(*after)} "
            f"| {_fmt(*ms('entropy_sampler_first'))} → {_fmt(*ms('entropy_sampler_last'))} "
            f"| {_fmt(*ms('response_length_first'), 1)} → {_fmt(*ms('response_length_last'), 1)} "
            f"| {_fmt(*ms('clip_frac'), 4)} | {_fmt(*ms('sampler_clip_frac'), 4)} | {_fmt(*ms('abs_log_ratio'), 4)} "
            f"| {ms('aqn_sigma_max')[0]:.0e} |"
        )

    curves_by_arm = {arm: [r["curves"] for _, r in sorted(arm_runs.items())] for arm, arm_runs in runs.items()}
    plot(curves_by_arm, os.path.join(results, "fidelity.png"), n_common)
    commands_file = os.path.join(out, "commands.txt")
    commands = open(commands_file).read().strip() if os.path.isfile(commands_file) else ""
    lines = [
        "# Fidelity experiment: results",
        "",
        f"SmolLM2-135M-Instruct ({exp['gguf']}), `configs/arithmetic_smollm2.py`, {steps} steps per run"
        f"{' (CPU smoke test: --tiny)' if exp['tiny'] else ''}. Means ± standard deviations over seeds; "
        f"windows and slopes over the first {n_common} steps (the steps every run reached).",
        "",
        "![curves](fidelity.png)",
        "",
        *table,
        "",
        "## The paper's claims",
        "",
    ]
    names = {
        "a": "(a) the NVFP4 policy samples with higher entropy than bf16 from the same weights, before training",
        "b": "(b) NVFP4 LoRA's reward grows at least as fast as bf16 LoRA's",
        "c": "(c) AQN adds to (b)",
        "ratio_source": "ratio against the sampler's log-probs (`rollout`) or the train forward's (`current`)",
    }
    for key, claim in claims.items():
        lines += [f"- **{names[key]}: {claim['verdict']}.** {claim['text']}", ""]
    lines += [
        "## Commands",
        "",
        "The launcher's calls on the GPU (the run directory's `commands.txt`; a call with the same `--out` "
        "resumes the unfinished runs), then this summary:",
        "",
        "```",
        commands,
        f"python -m experiments.fidelity.run --summarize --out {out} --results {results}",
        "```",
        "",
    ]
    with open(os.path.join(results, "results.md"), "w") as f:
        f.write("\n".join(lines))
    summary = {
        "experiment": exp,
        "common_steps": n_common,
        "greedy_before": before,
        "arms": arm_summary,
        "runs": {arm: {str(seed): s for seed, s in v.items()} for arm, v in per_run.items()},
        "claims": claims,
        "entropy": None
        if entropy is None
        else {k: v for k, v in entropy.items() if k not in ("models", "nvfp4_on_bf16_samples")},
    }
    with open(os.path.join(results, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    curves_json = {
        arm: {
            str(seed): {k: [None if not math.isfinite(x) else x for x in v.tolist()] for k, v in r["curves"].items()}
            for seed, r in arm_runs.items()
        }
        for arm, arm_runs in runs.items()
    }
    with open(os.path.join(results, "curves.json"), "w") as f:
        json.dump({"tags": TAGS, "labels": ARM_LABELS, "runs": curves_json}, f)
    print("\n".join(lines))
    return summary
