"""The Qwen2.5-Coder-1.5B / GSM8K claims experiment's summary: PNG, results.md, summary.json, curves.json.

  python -m experiments.qwen_gsm8k.run --summarize --out qg --results experiments/qwen_gsm8k/results

Reads <out>/experiment.json, calls.jsonl, commands.txt, base/{entropy.json, bf16/, nvfp4/} and every
<out>/runs/<arm>/seed<k>/ (tensorboard/scalars.jsonl, eval/step_<steps>/summary.json). Runs may be
incomplete: every per-step number uses the steps all runs reached ("common steps").

Growth measures of the reward (the mean reward of the sampled rollouts), per run over the common steps:
- slope: least-squares slope per 100 steps;
- relative growth: mean of the last 20% of steps / mean of the first 10% - 1;
- steps to threshold: the first step where the trailing moving average (window common/20) reaches
  the threshold = mean over all runs of the first-10% reward + THRESHOLD_GAIN (one threshold for all).
Verdicts: (b) and (c) compare growth step by step (`paired`: runs of one seed sample the same prompts
at each step whatever the arm): per seed, the slope of the reward difference b - a per 100 steps over
the steps both reached; over seeds, its mean with a Student's t 95% interval from the spread between
seeds; supported if the interval is above 0, not supported if below 0, else inconclusive (one seed:
inconclusive). (d): final greedy GSM8K accuracy b >= a over seeds: supported if the mean difference
is >= 0, not supported if < -2 SE (Welch), else inconclusive; with one seed: "inconclusive" (one seed).
(b) and (d) are judged against bf16 (equal lr) and bf16_lr5e-6 (the reference's lrs); the claim's
verdict is "supported" if both are, "not supported" if either is not, else inconclusive.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments.fidelity.summarize import _jsonl_curves, _mean_std, _smooth, claim_a, compare, read_experiment

MODEL_NAME = "Qwen2.5-Coder-1.5B-Instruct"
GSM8K, MATH500 = "gsm8k_test", "math500_test"
THRESHOLD_GAIN = 0.05
# (b, a) pairs of arms compared step by step: quantization, AQN with and without it, the learning rate.
PAIRS = (
    ("nvfp4", "bf16"),
    ("nvfp4", "bf16_lr5e-6"),
    ("nvfp4_aqn", "nvfp4"),
    ("nvfp4_aqn", "bf16"),
    ("bf16_aqn", "bf16"),
    ("bf16", "bf16_lr5e-6"),
)
LABELS = {
    "bf16_lr5e-6": "bf16 LoRA, lr 5e-6",
    "bf16": "bf16 LoRA, lr 1e-5",
    "nvfp4": "NVFP4 LoRA",
    "nvfp4_aqn": "NVFP4 LoRA + AQN (QeRL)",
    "bf16_aqn": "bf16 LoRA + AQN",
}


def _arm_specs() -> dict[str, dict]:
    from configs.gsm8k_claims import ARMS  # noqa: PLC0415

    return ARMS


def _eval(summary_file: str) -> dict[str, dict]:
    """dataset -> {"pass_at_1", "n"} of an evaluation's summary.json ({} if absent)."""
    if not os.path.isfile(summary_file):
        return {}
    datasets = json.load(open(summary_file))["datasets"]
    return {k: {"pass_at_1": float(v["pass_at_1"]), "n": int(v["num_examples"])} for k, v in datasets.items()}


def load_runs(out: str, steps: int) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for arm in _arm_specs():
        arm_dir = os.path.join(out, "runs", arm)
        for name in sorted(os.listdir(arm_dir)) if os.path.isdir(arm_dir) else []:
            jsonl = os.path.join(arm_dir, name, "tensorboard", "scalars.jsonl")
            if name.startswith("seed") and os.path.isfile(jsonl):
                curves = _jsonl_curves(jsonl)
                after = _eval(os.path.join(arm_dir, name, "eval", f"step_{steps}", "summary.json"))
                runs.setdefault(arm, {})[int(name[4:])] = {
                    "curves": curves,
                    "steps": len(curves["reward"]),
                    "after": after,
                }
    return runs


# ----------------------------------------------------------------------------- statistics


def growth(reward: np.ndarray, threshold: float, window: int) -> dict[str, float | int | None]:
    """slope per 100 steps, relative growth (last 20% / first 10% - 1), first step at the threshold."""
    n = len(reward)
    ok = np.isfinite(reward)
    slope = float(np.polyfit(np.arange(n)[ok], reward[ok], 1)[0] * 100) if ok.sum() > 1 else float("nan")
    first = float(np.nanmean(reward[: max(1, n // 10)])) if ok.any() else float("nan")
    last = float(np.nanmean(reward[n - max(1, n // 5) :])) if ok.any() else float("nan")
    rel = last / first - 1 if first > 0 else float("nan")
    reached = np.nonzero(_smooth(reward, window) >= threshold)[0]
    return {
        "slope_per_100": slope,
        "first": first,
        "last": last,
        "relative_growth": rel,
        "steps_to_threshold": int(reached[0]) if len(reached) else None,
    }


# Two-sided 95% quantiles of Student's t for 1..10 degrees of freedom (more: 2.0).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def paired(runs: dict, b: str, a: str, key: str = "reward", start: int = 0) -> dict | None:
    """Arm b minus arm a at the same step of the same seed: runs of one seed sample the same prompts
    at each step whatever the arm, so the step's prompt difficulty cancels in the difference.

    Per seed both arms ran, over the steps from `start` both reached: the difference's mean (level)
    and least-squares slope per 100 steps (growth). Over seeds: their means and standard errors from
    the spread between seeds (a run's trajectory is autocorrelated, so its steps are not independent
    draws; with one seed the errors are unknown, NaN). None if the arms share no seed."""
    levels, slopes, seeds, counts = [], [], [], []
    for seed in sorted(set(runs.get(a, {})) & set(runs.get(b, {}))):
        ca, cb = runs[a][seed]["curves"][key], runs[b][seed]["curves"][key]
        n = min(len(ca), len(cb))
        d = cb[start:n] - ca[start:n]
        steps = np.arange(start, n)[np.isfinite(d)]
        d = d[np.isfinite(d)]
        if len(d) < 2:
            continue
        levels.append(float(d.mean()))
        slopes.append(float(np.polyfit(steps, d, 1)[0] * 100))
        seeds.append(seed)
        counts.append(len(d))
    if not seeds:
        return None
    se = lambda v: float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")  # noqa: E731
    return {
        "seeds": seeds,
        "steps_per_seed": counts,
        "level_per_seed": levels,
        "slope_per_seed": slopes,
        "mean_diff": float(np.mean(levels)),
        "se": se(levels),
        "slope_per_100": float(np.mean(slopes)),
        "slope_se": se(slopes),
    }


def judge_paired(name_b: str, name_a: str, p: dict | None, *, what: str) -> dict:
    """A paired growth comparison's verdict from the 95% interval (Student's t over seeds) of the mean
    per-seed slope difference: supported above 0, not supported below 0, else inconclusive; one
    seed: inconclusive."""
    if p is None:
        return {"verdict": "not measured", "text": f"{name_b} and {name_a} share no seed"}
    n = len(p["seeds"])
    head = (
        f"{what}, {name_b} minus {name_a} at the same steps of the same seed (seeds {p['seeds']}, "
        f"{p['steps_per_seed']} steps): slope per 100 steps by seed "
        f"{', '.join(f'{v:+.3f}' for v in p['slope_per_seed'])}, mean {p['slope_per_100']:+.3f}"
    )
    if n < 2:
        return {"verdict": "inconclusive", "reason": "one seed", "text": head, **p}
    t = T975[n - 2] if n - 1 <= len(T975) else 2.0
    lo, hi = p["slope_per_100"] - t * p["slope_se"], p["slope_per_100"] + t * p["slope_se"]
    verdict = "supported" if lo > 0 else ("not supported" if hi < 0 else "inconclusive")
    text = f"{head} (95% interval {lo:+.3f} .. {hi:+.3f}); level {p['mean_diff']:+.4f} (SE {p['se']:.4f})"
    return {"verdict": verdict, "text": text, **p}


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def judge(name_a: str, a: list[float], name_b: str, b: list[float], *, what: str) -> dict:
    """b >= a over seeds: supported if the mean difference is >= 0, not supported if < -2 SE (Welch)."""
    a, b = _finite(a), _finite(b)
    ma, sa = _mean_std(a)
    mb, sb = _mean_std(b)
    def side(name: str, values: list[float], m: float, s: float) -> str:
        return f"{name} {m:+.4f} ± {s:.4f} (n={len(values)})" if values else f"{name} not measured (n=0)"

    text = f"{what} (mean ± std over seeds): {side(name_b, b, mb, sb)}, {side(name_a, a, ma, sa)}"
    if min(len(a), len(b)) < 2:
        return {"verdict": "inconclusive", "reason": "one seed" if min(len(a), len(b)) == 1 else "no runs", "text": text}
    c = compare(a, b)
    diff, se = c["diff"], c["se"]
    verdict = "supported" if diff >= 0 else ("not supported" if diff < -2 * se else "inconclusive")
    return {"verdict": verdict, "diff": diff, "se": se, "text": f"{text}; difference {diff:+.4f} (SE {se:.4f})"}


def combine(parts: dict[str, dict]) -> str:
    """supported if every part is, not supported if any part is not, else inconclusive."""
    verdicts = [p["verdict"] for p in parts.values()]
    if verdicts and all(v == "supported" for v in verdicts):
        return "supported"
    return "not supported" if "not supported" in verdicts else "inconclusive"


def _claim(parts: dict[str, dict]) -> dict:
    if not parts:
        return {"verdict": "not measured", "text": "the arms it compares have no runs"}
    return {"verdict": combine(parts), "parts": parts}


# ----------------------------------------------------------------------------- output


def plot(runs, before: dict[str, float | None], steps: int, n_common: int, path: str) -> None:
    """Reward and sampled-token entropy (each arm over the steps all its seeds reached), greedy
    accuracy before / after, and each arm's reward minus bf16's at the same step (`paired`)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.6))
    specs = _arm_specs()
    longest = max(r["steps"] for arm_runs in runs.values() for r in arm_runs.values())
    w = max(1, longest // 10)
    for i, (arm, arm_runs) in enumerate(runs.items()):
        color = f"C{i}"
        n_arm = min(r["steps"] for r in arm_runs.values())
        label = f"{LABELS.get(arm, arm)} ({len(arm_runs)} seeds, {n_arm} steps)"
        for ax, key in ((axes[0], "reward"), (axes[1], "entropy_sampler")):
            ys = np.stack([_smooth(r["curves"][key][:n_arm], w) for r in arm_runs.values()])
            if np.isfinite(ys).any():
                mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
                ax.plot(np.arange(n_arm), mean, color=color, label=label)
                ax.fill_between(np.arange(n_arm), mean - std, mean + std, color=color, alpha=0.2)
        b = before.get(specs[arm]["quant"])
        after = _finite(r["after"].get(GSM8K, {}).get("pass_at_1") for r in arm_runs.values())
        xs, ys, es = ([0], [b], [0.0]) if b is not None else ([], [], [])
        if after:
            xs, ys, es = [*xs, steps], [*ys, float(np.mean(after))], [*es, float(np.std(after))]
        if xs:
            axes[2].errorbar(xs, ys, yerr=es, color=color, marker="o", capsize=4, label=label)
        if arm != "bf16" and "bf16" in runs:
            # over the steps every paired seed reached, like the per-arm curves (no tail of one seed)
            pairs = [(r, runs["bf16"][seed]) for seed, r in arm_runs.items() if seed in runs["bf16"]]
            n = min((min(r["steps"], ref["steps"]) for r, ref in pairs), default=0)
            if n:
                diffs = np.stack([r["curves"]["reward"][:n] - ref["curves"]["reward"][:n] for r, ref in pairs])
                axes[3].plot(np.arange(n), _smooth(np.nanmean(diffs, 0), 2 * w), color=color, label=label)
    axes[3].axhline(0.0, color="k", lw=0.8)
    for ax, label in zip(
        axes,
        (
            "reward (mean of the sampled rollouts)",
            "entropy of the sampled tokens (nats, -log p)",
            "greedy pass@1, GSM8K test (1319)",
            "reward minus bf16's (same seed, same step; 2x the window)",
        ),
    ):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{MODEL_NAME}, GSM8K, DAPO + LoRA ({steps}-step schedule): mean ± std over seeds, moving average of {w} steps"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gpu_minutes(out: str) -> float:
    path = os.path.join(out, "calls.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()] if os.path.isfile(path) else []
    return float(sum(r["minutes"] for r in rows))


def _finite_or_none(x):
    """The JSON-safe copy of x: NaN and inf become null."""
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _pm(mean: float, se: float, digits: int) -> str:
    return f"{mean:+.{digits}f} ± " + (f"{se:.{digits}f}" if math.isfinite(se) else "n/a")


def _fmt(values, digits: int = 3) -> str:
    m, s = _mean_std(_finite(values))
    return "n/a" if not math.isfinite(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def summarize(out: str, results: str) -> dict:
    exp, runs, entropy = read_experiment(out, results, load_runs)
    steps = exp["steps"]
    base_evals = {q: _eval(os.path.join(out, "base", q, "summary.json")) for q in ("bf16", "nvfp4")}
    before = {q: e.get(GSM8K, {}).get("pass_at_1") for q, e in base_evals.items()}
    n_common = min(r["steps"] for arm_runs in runs.values() for r in arm_runs.values())
    window = max(1, n_common // 20)
    starts = [np.nanmean(r["curves"]["reward"][: max(1, n_common // 10)]) for a in runs.values() for r in a.values()]
    threshold = float(np.nanmean(starts)) + THRESHOLD_GAIN
    stats = {
        arm: {seed: growth(r["curves"]["reward"][:n_common], threshold, window) for seed, r in arm_runs.items()}
        for arm, arm_runs in runs.items()
    }
    slopes = {arm: [s["slope_per_100"] for s in v.values()] for arm, v in stats.items()}
    final = {arm: [r["after"].get(GSM8K, {}).get("pass_at_1") for r in v.values()] for arm, v in runs.items()}

    def parts(b_arm: str, refs: tuple[str, ...], values: dict, what: str) -> dict:
        return {
            f"{b_arm}_vs_{a}": judge(a, values[a], b_arm, values[b_arm], what=what)
            for a in refs
            if a in values and b_arm in values
        }

    def growth_parts(b_arm: str, refs: tuple[str, ...]) -> dict:
        return {
            f"{b_arm}_vs_{a}": judge_paired(b_arm, a, paired(runs, b_arm, a), what="reward")
            for a in refs
            if a in runs and b_arm in runs
        }

    claims = {
        "a": claim_a(entropy),
        "b": _claim(growth_parts("nvfp4", ("bf16", "bf16_lr5e-6"))),
        "c": _claim(growth_parts("nvfp4_aqn", ("nvfp4",))),
        "d": _claim(
            parts("nvfp4_aqn", ("bf16", "bf16_lr5e-6"), final, "final greedy GSM8K pass@1")
        ),
    }

    specs = _arm_specs()
    arms_out, table = {}, [
        "| arm | seeds (common steps) | reward, first 10% → last 20% | slope / 100 steps | relative growth "
        f"| steps to reward {threshold:.3f} (reached) | truncated | sampled-token entropy, first → last "
        "| greedy GSM8K, before → after | MATH500 after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, arm_runs in runs.items():
        s = list(stats[arm].values())
        spec = specs[arm]
        trunc = _finite(float(np.nanmean(r["curves"]["truncated"][:n_common])) for r in arm_runs.values())
        ent = lambda sl, arm_runs=arm_runs: [float(np.nanmean(r["curves"]["entropy_sampler"][sl])) for r in arm_runs.values()]  # noqa: E731
        reached = [x["steps_to_threshold"] for x in s if x["steps_to_threshold"] is not None]
        n_after = [r["after"].get(GSM8K, {}).get("n") for r in arm_runs.values() if r["after"]]
        b = before[spec["quant"]]
        arms_out[arm] = {
            "quant": spec["quant"],
            "lr": spec["lr"],
            "aqn": bool(spec["aqn"]),
            "seeds": sorted(arm_runs),
            "steps": min(r["steps"] for r in arm_runs.values()),
            "eval_before": {"gsm8k_test": b, "n": base_evals[spec["quant"]].get(GSM8K, {}).get("n")},
            "eval_after": {
                "gsm8k_test": final[arm],
                "n": n_after[0] if n_after else None,
                "math500_test": [r["after"].get(MATH500, {}).get("pass_at_1") for r in arm_runs.values()],
            },
            "reward_slope_per_100": slopes[arm],
            "truncated_frac": float(np.mean(trunc)) if trunc else None,
            "relative_growth": [x["relative_growth"] for x in s],
            "steps_to_threshold": [x["steps_to_threshold"] for x in s],
        }
        table.append(
            f"| {LABELS.get(arm, arm)} | {len(s)} ({n_common}/{steps}, {len(n_after)} evaluated) "
            f"| {_fmt([x['first'] for x in s])} → {_fmt([x['last'] for x in s])} | {_fmt(slopes[arm], 4)} "
            f"| {_fmt([x['relative_growth'] for x in s], 2)} "
            f"| {_fmt(reached, 0) if reached else 'never'} ({len(reached)}/{len(s)}) "
            f"| {_fmt(trunc, 3)} | {_fmt(ent(slice(0, max(1, n_common // 10))))} → "
            f"{_fmt(ent(slice(n_common - max(1, n_common // 5), n_common)))} "
            f"| {'n/a' if b is None else f'{b:.3f}'} → {_fmt(final[arm])} "
            f"| {_fmt(arms_out[arm]['eval_after']['math500_test'])} |"
        )

    paired_table = {
        f"{b}_minus_{a}": {key: paired(runs, b, a, key) for key in ("reward", "entropy_sampler")}
        for b, a in PAIRS
        if a in runs and b in runs
    }
    paired_lines = [
        "| b minus a (same seed, same step) | seeds (steps) | reward level | reward slope / 100 steps "
        "| sampled-token entropy level |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, d in paired_table.items():
        r, e = d["reward"], d["entropy_sampler"]
        if r is None:
            continue
        paired_lines.append(
            f"| {name.replace('_minus_', ' - ')} | {r['seeds']} ({r['steps_per_seed']}) "
            f"| {_pm(r['mean_diff'], r['se'], 4)} | {_pm(r['slope_per_100'], r['slope_se'], 3)} "
            f"| {_pm(e['mean_diff'], e['se'], 4)} |"
        )
    gpu_minutes = _gpu_minutes(out)
    summary = {
        "model": {"name": MODEL_NAME, "sha256": exp.get("sha256"), "gguf": exp.get("gguf")},
        "task": "gsm8k",
        "arms": arms_out,
        "claims": claims,
        "gpu_minutes": gpu_minutes,
        "common_steps": n_common,
        "paired": paired_table,
        "threshold": {"reward": threshold, "gain": THRESHOLD_GAIN, "window": window},
    }
    plot(runs, before, steps, n_common, os.path.join(results, "qwen_gsm8k.png"))

    def claim_lines(key: str, title: str) -> list[str]:
        c = claims[key]
        if "parts" not in c:
            return [f"- **({key}) {title}: {c['verdict']}.** {c.get('text', '')}"]
        lines = [f"- **({key}) {title}: {c['verdict']}.**"]
        for name, p in c["parts"].items():
            reason = f" ({p['reason']})" if "reason" in p else ""
            lines.append(f"  - {name}: {p['verdict']}{reason}. {p['text']}")
        return lines

    commands_file = os.path.join(out, "commands.txt")
    commands = open(commands_file).read().strip() if os.path.isfile(commands_file) else ""
    lines = [
        "# Qwen2.5-Coder-1.5B-Instruct on GSM8K: results",
        "",
        f"`configs/gsm8k_claims.py`, {steps} steps per run, model {exp.get('gguf')} (sha256 {exp.get('sha256')}). "
        f"Per-step numbers use the first {n_common} steps, which every run reached. GPU minutes: {gpu_minutes:.1f} "
        "(`calls.jsonl`: the launcher's calls and the device time noted beside them).",
        "",
        "![curves](qwen_gsm8k.png)",
        "",
        *table,
        "",
        f"Threshold: the mean first-10% reward over all runs + {THRESHOLD_GAIN} = {threshold:.3f}, reached by the "
        f"trailing moving average of {window} steps. Relative growth: last-20% mean / first-10% mean - 1.",
        "",
        "## Paired differences",
        "",
        "Runs of one seed sample the same prompts at each step whatever the arm. Per seed both arms ran: "
        "the difference's mean and slope over the steps both reached; here their means over seeds "
        "± the standard error from the spread between seeds (n/a with one seed).",
        "",
        *paired_lines,
        "",
        "## Claims",
        "",
        *claim_lines("a", "NVFP4 samples with higher entropy than bf16 before training"),
        *claim_lines("b", "NVFP4 LoRA's reward grows at least as fast as bf16 LoRA's"),
        *claim_lines("c", "AQN adds to (b)"),
        *claim_lines("d", "QeRL's final greedy GSM8K accuracy >= bf16 LoRA's"),
        "",
        "## Commands",
        "",
        "```",
        commands,
        f"python -m experiments.qwen_gsm8k.run --summarize --out {out} --results {results}",
        "```",
        "",
    ]
    with open(os.path.join(results, "results.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(results, "summary.json"), "w") as f:
        json.dump(_finite_or_none(summary), f, indent=2)
    curves = {
        arm: {
            str(seed): {k: [x if math.isfinite(x) else None for x in v.tolist()] for k, v in r["curves"].items()}
            for seed, r in arm_runs.items()
        }
        for arm, arm_runs in runs.items()
    }
    with open(os.path.join(results, "curves.json"), "w") as f:
        json.dump({"labels": LABELS, "runs": curves}, f)
    print("\n".join(lines))
    return summary
