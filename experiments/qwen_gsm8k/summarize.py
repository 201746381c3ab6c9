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
Verdicts: (b) b >= a: supported if mean slope difference >= 0, not supported if < -2 SE (Welch, over
seeds), else inconclusive; (c) strictly more: supported if > 2 SE, not supported if <= 0; (d) the same
rule as (b) on the final greedy GSM8K accuracy. With one seed in an arm: "inconclusive" (one seed).
(b) and (d) are judged against bf16 (equal lr) and bf16_lr5e-6 (the reference's lrs); the claim's
verdict is "supported" if both are, "not supported" if either is not, else inconclusive.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments.fidelity.summarize import _jsonl_curves, _mean_std, _smooth, claim_a, compare

MODEL_NAME = "Qwen2.5-Coder-1.5B-Instruct"
GSM8K, MATH500 = "gsm8k_test", "math500_test"
THRESHOLD_GAIN = 0.05
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


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def judge(name_a: str, a: list[float], name_b: str, b: list[float], *, what: str, strict: bool) -> dict:
    """b against a over seeds: b >= a (strict=False) or b > a (strict=True), Welch standard error."""
    a, b = _finite(a), _finite(b)
    ma, sa = _mean_std(a)
    mb, sb = _mean_std(b)
    text = f"{what} (mean ± std over seeds): {name_b} {mb:+.4f} ± {sb:.4f} (n={len(b)}), {name_a} {ma:+.4f} ± {sa:.4f} (n={len(a)})"
    if min(len(a), len(b)) < 2:
        return {"verdict": "inconclusive", "reason": "one seed" if min(len(a), len(b)) == 1 else "no runs", "text": text}
    c = compare(a, b)
    diff, se = c["diff"], c["se"]
    if strict:
        verdict = "supported" if diff > 2 * se else ("not supported" if diff <= 0 else "inconclusive")
    else:
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
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    w = max(1, n_common // 20)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    specs = _arm_specs()
    for i, (arm, arm_runs) in enumerate(runs.items()):
        color = f"C{i}"
        label = f"{LABELS.get(arm, arm)} ({len(arm_runs)} seeds)"
        for ax, key in ((axes[0], "reward"), (axes[1], "entropy_sampler")):
            ys = np.stack([_smooth(r["curves"][key][:n_common], w) for r in arm_runs.values()])
            if np.isfinite(ys).any():
                mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
                ax.plot(np.arange(n_common), mean, color=color, label=label)
                ax.fill_between(np.arange(n_common), mean - std, mean + std, color=color, alpha=0.2)
        b = before.get(specs[arm]["quant"])
        after = _finite(r["after"].get(GSM8K, {}).get("pass_at_1") for r in arm_runs.values())
        xs, ys, es = ([0], [b], [0.0]) if b is not None else ([], [], [])
        if after:
            xs, ys, es = [*xs, steps], [*ys, float(np.mean(after))], [*es, float(np.std(after))]
        if xs:
            axes[2].errorbar(xs, ys, yerr=es, color=color, marker="o", capsize=4, label=label)
    for ax, label in zip(
        axes,
        (
            "reward (mean of the sampled rollouts)",
            "entropy of the sampled tokens (nats, -log p)",
            "greedy pass@1, GSM8K test (1319)",
        ),
    ):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{MODEL_NAME}, GSM8K, DAPO + LoRA: mean ± std over seeds (moving average of {w} steps; "
        f"{n_common} common steps of {steps})"
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


def _fmt(values, digits: int = 3) -> str:
    m, s = _mean_std(_finite(values))
    return "n/a" if not math.isfinite(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def summarize(out: str, results: str) -> dict:
    exp = json.load(open(os.path.join(out, "experiment.json")))
    steps = exp["steps"]
    runs = load_runs(out, steps)
    if not runs:
        raise SystemExit(f"{out}/runs holds no run with scalars.jsonl: nothing to summarize")
    os.makedirs(results, exist_ok=True)
    entropy_file = os.path.join(out, "base", "entropy.json")
    entropy = json.load(open(entropy_file)) if os.path.isfile(entropy_file) else None
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

    def parts(b_arm: str, refs: tuple[str, ...], values: dict, what: str, strict: bool) -> dict:
        return {
            f"{b_arm}_vs_{a}": judge(a, values[a], b_arm, values[b_arm], what=what, strict=strict)
            for a in refs
            if a in values and b_arm in values
        }

    slope_what = f"reward slope per 100 steps over the first {n_common} steps"
    claims = {
        "a": claim_a(entropy),
        "b": _claim(parts("nvfp4", ("bf16", "bf16_lr5e-6"), slopes, slope_what, strict=False)),
        "c": _claim(parts("nvfp4_aqn", ("nvfp4",), slopes, slope_what, strict=True)),
        "d": _claim(
            parts("nvfp4_aqn", ("bf16", "bf16_lr5e-6"), final, "final greedy GSM8K pass@1", strict=False)
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

    gpu_minutes = _gpu_minutes(out)
    summary = {
        "model": {"name": MODEL_NAME, "sha256": exp.get("sha256"), "gguf": exp.get("gguf")},
        "task": "gsm8k",
        "arms": arms_out,
        "claims": claims,
        "gpu_minutes": gpu_minutes,
        "common_steps": n_common,
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
        "(the launcher's wall time, all calls).",
        "",
        "![curves](qwen_gsm8k.png)",
        "",
        *table,
        "",
        f"Threshold: the mean first-10% reward over all runs + {THRESHOLD_GAIN} = {threshold:.3f}, reached by the "
        f"trailing moving average of {window} steps. Relative growth: last-20% mean / first-10% mean - 1.",
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
