"""The Qwen2.5-Coder-1.5B / GSM8K claims experiment's summary: PNG, results.md, summary.json, curves.json.

  python -m experiments.qwen_gsm8k.run --summarize --out qg --results experiments/qwen_gsm8k/results

Reads <out>/experiment.json, calls.jsonl, commands.txt, base/{entropy.json, bf16/, nvfp4/} and every
<out>/runs/<arm>/seed<k>/ (tensorboard/scalars.jsonl, eval/step_<steps>/summary.json and, where
kept, gsm8k_test.problems.jsonl.gz). Runs may be incomplete: every per-step number uses the steps
all runs reached ("common steps").

Growth measures of the reward (the mean reward of the sampled rollouts), per run over the common steps:
- slope: least-squares slope per 100 steps;
- relative growth: mean of the last 20% of steps / mean of the first 10% - 1;
- headroom gain: (last-20% mean - first-10% mean) / (1 - first-10% mean);
- steps to threshold: the first step where the trailing moving average (window common/20) reaches
  the threshold = mean over all runs of the first-10% reward + THRESHOLD_GAIN (one threshold for all).
Verdicts: the pre-registered rules v3 of PROTOCOL.md (experiments/stats.py): (b) non-inferiority of
the paired reward slope at MARGINS["b"], (c) superiority or equivalence at MARGINS["c"], (d)
non-inferiority of the final greedy GSM8K accuracy (Welch, t) at MARGINS["d"]. The verdicts of the
earlier rules v1 and v2 are kept beside them (`claims_by_rule`), as PROTOCOL.md's history says.
"""

from __future__ import annotations

import gzip
import json
import math
import os

import numpy as np

from experiments import stats
from experiments.fidelity.summarize import _jsonl_curves, _mean_std, _smooth, claim_a, compare, read_experiment

MODEL_NAME = "Qwen2.5-Coder-1.5B-Instruct"
GSM8K, MATH500 = "gsm8k_test", "math500_test"
PROBLEMS_FILE = "gsm8k_test.problems.jsonl.gz"  # written by qerl_jax.evaluation (PROBLEMS_SUFFIX)
THRESHOLD_GAIN = 0.05
PROTOCOL = "PROTOCOL.md, rule v3 (commit 8f40f00)"
MARGINS = {"b": 0.010, "c": 0.010, "d": 0.010}  # reward per 100 steps (b, c); greedy accuracy (d)
BASE_NOTE = (
    "bf16 = the GGUF Q4_K_M file dequantized to bf16 (not a bf16 checkpoint); NVFP4 = re-quantized from "
    "that Q4_K_M model, round-to-nearest"
)
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
    "bf16_lr5e-6": "bf16 (Q4_K_M) LoRA, lr 5e-6",
    "bf16": "bf16 (Q4_K_M) LoRA, lr 1e-5",
    "nvfp4": "NVFP4 (from Q4_K_M) LoRA",
    "nvfp4_aqn": "NVFP4 (from Q4_K_M) LoRA + AQN (QeRL)",
    "bf16_aqn": "bf16 (Q4_K_M) LoRA + AQN",
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


def read_problems(path: str) -> dict[str, bool] | None:
    """problem id -> greedy correct, from an evaluation's problems file (None if it was not kept)."""
    if not os.path.isfile(path):
        return None
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["id"]: bool(r["correct"]) for r in rows if r["metric"] == "pass_at_1"}


def load_runs(out: str, steps: int) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for arm in _arm_specs():
        arm_dir = os.path.join(out, "runs", arm)
        for name in sorted(os.listdir(arm_dir)) if os.path.isdir(arm_dir) else []:
            jsonl = os.path.join(arm_dir, name, "tensorboard", "scalars.jsonl")
            if name.startswith("seed") and os.path.isfile(jsonl):
                curves = _jsonl_curves(jsonl)
                eval_dir = os.path.join(arm_dir, name, "eval", f"step_{steps}")
                runs.setdefault(arm, {})[int(name[4:])] = {
                    "curves": curves,
                    "steps": len(curves["reward"]),
                    "after": _eval(os.path.join(eval_dir, "summary.json")),
                    "problems": read_problems(os.path.join(eval_dir, PROBLEMS_FILE)),
                }
    return runs


# ----------------------------------------------------------------------------- statistics


def growth(reward: np.ndarray, threshold: float, window: int) -> dict[str, float | int | None]:
    """slope per 100 steps, relative growth (last 20% / first 10% - 1), headroom gain, first step at the threshold."""
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
        "headroom_gain": (last - first) / (1 - first) if first < 1 else float("nan"),
        "steps_to_threshold": int(reached[0]) if len(reached) else None,
    }


# Two-sided 95% quantiles of Student's t for 1..10 degrees of freedom (more: 2.0): rule v2's table.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def paired(runs: dict, b: str, a: str, key: str = "reward", start: int = 0, end: int | None = None) -> dict | None:
    """Arm b minus arm a at the same step of the same seed: runs of one seed sample the same prompts
    at each step whatever the arm, so the step's prompt difficulty cancels in the difference.

    Per seed both arms ran, over the steps from `start` (to `end`) both reached (3 at least): the difference's
    mean (level) and least-squares slope per 100 steps (growth), each with its within-run standard
    error (`stats.mean_within`, `stats.slope_within`). Over seeds: `level` and `slope`, the rule v3
    intervals (`stats.over_seeds`); `se` and `slope_se` are the between-seed standard errors alone
    (rule v2; NaN with one seed). None if the arms share no seed."""
    per_seed: dict[str, list] = {k: [] for k in ("seeds", "counts", "levels", "level_se", "slopes", "slope_se", "rho")}
    for seed in sorted(set(runs.get(a, {})) & set(runs.get(b, {}))):
        ca, cb = runs[a][seed]["curves"][key], runs[b][seed]["curves"][key]
        n = min(len(ca), len(cb), len(ca) if end is None else end)
        d = cb[start:n] - ca[start:n]
        steps = np.arange(start, n)[np.isfinite(d)]
        d = d[np.isfinite(d)]
        if len(d) < 3:
            continue
        level, slope = stats.mean_within(d), stats.slope_within(steps, d)
        for k, v in (("seeds", seed), ("counts", len(d)), ("levels", level["value"]), ("level_se", level["se"])):
            per_seed[k].append(v)
        for k, v in (("slopes", slope["value"]), ("slope_se", slope["se"]), ("rho", slope["rho"])):
            per_seed[k].append(v)
    if not per_seed["seeds"]:
        return None
    between = lambda v: float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")  # noqa: E731
    return {
        "seeds": per_seed["seeds"],
        "steps_per_seed": per_seed["counts"],
        "level_per_seed": per_seed["levels"],
        "slope_per_seed": per_seed["slopes"],
        "slope_within_se_per_seed": per_seed["slope_se"],
        "slope_residual_rho_per_seed": per_seed["rho"],
        "level": stats.over_seeds(per_seed["levels"], per_seed["level_se"]),
        "slope": stats.over_seeds(per_seed["slopes"], per_seed["slope_se"]),
        "mean_diff": float(np.mean(per_seed["levels"])),
        "se": between(per_seed["levels"]),
        "slope_per_100": float(np.mean(per_seed["slopes"])),
        "slope_se": between(per_seed["slopes"]),
    }


def judge_paired(name_b: str, name_a: str, p: dict | None, *, what: str) -> dict:
    """Rule v2 (kept for the history): the 95% interval (Student's t over seeds, between-seed SE
    only) of the mean per-seed slope difference: supported above 0, not supported below 0, else
    inconclusive; one seed: inconclusive."""
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


def verdict_v1(a: list[float], b: list[float], *, strict: bool) -> str:
    """Rule v1 (kept for the history), per-arm values over seeds with a Welch SE: b >= a (supported
    if the difference is >= 0, not supported if < -2 SE) or, strict, b > a (supported if > 2 SE,
    not supported if <= 0); fewer than two seeds a side: inconclusive."""
    a, b = _finite(a), _finite(b)
    if min(len(a), len(b)) < 2:
        return "inconclusive"
    c = compare(a, b)
    diff, se = c["diff"], c["se"]
    if strict:
        return "supported" if diff > 2 * se else ("not supported" if diff <= 0 else "inconclusive")
    return "supported" if diff >= 0 else ("not supported" if diff < -2 * se else "inconclusive")


def _interval_text(iv: dict, digits: int) -> str:
    f = f"+.{digits}f"
    return (
        f"mean {iv['mean']:{f}}, SE {iv['se']:.{digits}f} (between seeds {iv['se_between']:.{digits}f}, within runs "
        f"{iv['se_within']:.{digits}f}), 95% interval {iv['lo']:{f}} .. {iv['hi']:{f}} (t, {iv['df']} df)"
    )


def judge_growth(name_b: str, name_a: str, p: dict | None, *, claim: str) -> dict:
    """Rule v3 on the paired reward slope: (b) non-inferiority at MARGINS["b"]; (c) superiority, or
    equivalence within MARGINS["c"] (`stats`). One seed: inconclusive."""
    if p is None:
        return {"verdict": "not measured", "text": f"{name_b} and {name_a} share no seed"}
    iv, margin = p["slope"], MARGINS[claim]
    head = (
        f"reward slope per 100 steps, {name_b} - {name_a} at the same steps of the same seed (seeds {p['seeds']}, "
        f"{p['steps_per_seed']} steps): by seed {', '.join(f'{v:+.4f}' for v in p['slope_per_seed'])} "
        f"(within-run SE {', '.join(f'{v:.4f}' for v in p['slope_within_se_per_seed'])})"
    )
    if iv["n"] < 2:
        return {"verdict": "inconclusive", "reason": "one seed", "text": head, **p}
    if claim == "b":
        verdict = stats.non_inferior(iv["lo"], iv["hi"], margin)
        reading = f"lower bound {'above' if iv['lo'] > -margin else 'not above'} -{margin:g}" + (
            "; above 0 too (faster)" if iv["lo"] > 0 else ""
        )
    else:
        verdict, reading = stats.superior_or_equivalent(iv["lo"], iv["hi"], margin)
    level = p["level"]
    text = f"{head}; {_interval_text(iv, 4)}: {reading}. Level {level['mean']:+.4f} (95% {level['lo']:+.4f} .. {level['hi']:+.4f})"
    return {"verdict": verdict, "reading": reading, "text": text, **p}


def mcnemar(runs: dict, b: str, a: str) -> dict | None:
    """The exact McNemar test of b against a on the greedy GSM8K problems, discordant counts summed
    over the seeds both kept per-problem outputs for; None where no seed pair has them."""
    b_only = a_only = 0
    seeds = []
    for seed in sorted(set(runs.get(a, {})) & set(runs.get(b, {}))):
        pa, pb = runs[a][seed].get("problems"), runs[b][seed].get("problems")
        if pa is None or pb is None:
            continue
        shared = pa.keys() & pb.keys()
        b_only += sum(pb[k] and not pa[k] for k in shared)
        a_only += sum(pa[k] and not pb[k] for k in shared)
        seeds.append(seed)
    if not seeds:
        return None
    return {"seeds": seeds, "b_only": b_only, "a_only": a_only, "p": stats.mcnemar_exact(b_only, a_only)}


def judge_accuracy(name_a: str, a: list[float], name_b: str, b: list[float], *, paired_test: dict | None) -> dict:
    """Rule v3 for (d): b - a of the final greedy accuracy over seeds (Welch, t at the Welch df),
    non-inferior at MARGINS["d"]; the per-problem McNemar test reported beside where kept."""
    a, b = _finite(a), _finite(b)
    w = stats.welch(a, b)
    values = lambda v: ", ".join(f"{x:.4f}" for x in v) or "none"  # noqa: E731
    text = f"final greedy GSM8K pass@1 by seed: {name_b} {values(b)}; {name_a} {values(a)}"
    extra = (
        "per-problem outputs not kept for these runs (no paired test)"
        if paired_test is None
        else f"McNemar over seeds {paired_test['seeds']}: {paired_test['b_only']} problems only {name_b} solved, "
        f"{paired_test['a_only']} only {name_a}, exact p {paired_test['p']:.3g}"
    )
    if min(len(a), len(b)) < 2:
        reason = "one seed" if min(len(a), len(b)) == 1 else "no runs"
        return {"verdict": "inconclusive", "reason": reason, "text": f"{text}; {extra}", "mcnemar": paired_test}
    verdict = stats.non_inferior(w["lo"], w["hi"], MARGINS["d"])
    text += (
        f"; difference {w['diff']:+.4f}, Welch SE {w['se']:.4f}, {w['df']:.1f} df, 95% interval "
        f"{w['lo']:+.4f} .. {w['hi']:+.4f} (margin -{MARGINS['d']:g}); {extra}"
    )
    return {"verdict": verdict, "text": text, "welch": w, "mcnemar": paired_test}


def combine(verdicts: list[str]) -> str:
    """supported if every part is, not supported if any part is not, else inconclusive."""
    if verdicts and all(v == "supported" for v in verdicts):
        return "supported"
    return "not supported" if "not supported" in verdicts else "inconclusive"


def _claim(parts: dict[str, dict]) -> dict:
    if not parts:
        return {"verdict": "not measured", "text": "the arms it compares have no runs"}
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts}


def headroom(stats_by_arm: dict, gains: dict, b: str, a: str) -> dict:
    """Headroom-normalised differences b - a (secondary): the reward's headroom gain paired by seed
    (between-seed interval, t(n - 1)) and the greedy headroom gain (Welch)."""
    seeds = sorted(set(stats_by_arm.get(a, {})) & set(stats_by_arm.get(b, {})))
    diffs = [stats_by_arm[b][s]["headroom_gain"] - stats_by_arm[a][s]["headroom_gain"] for s in seeds]
    diffs = _finite(diffs)
    return {
        "reward": stats.over_seeds(diffs, [0.0] * len(diffs)),
        "greedy": stats.welch(_finite(gains.get(a, [])), _finite(gains.get(b, []))),
    }


def _headroom_text(h: dict, primary: float) -> str:
    """Both headroom-normalised differences, each marked where it points the other way from the primary measure."""
    other = lambda v: math.isfinite(primary) and v * primary < 0  # noqa: E731
    r, g = h["reward"], h["greedy"]
    pieces = []
    if r["n"]:
        flip = " (the other way from the primary measure)" if other(r["mean"]) else ""
        pieces.append(f"reward headroom gain {r['mean']:+.3f} (95% {r['lo']:+.3f} .. {r['hi']:+.3f}, n={r['n']}){flip}")
    if math.isfinite(g["diff"]):
        flip = " (the other way from the primary measure)" if other(g["diff"]) else ""
        pieces.append(f"greedy headroom gain {g['diff']:+.3f} (95% {g['lo']:+.3f} .. {g['hi']:+.3f}){flip}")
    return "Headroom-normalised: " + ("; ".join(pieces) or "n/a")


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


def _spread(s: float, digits: int) -> str:
    """A spread with `digits` decimals, two significant digits where that would print as zero, "0" if it is."""
    if not math.isfinite(s):
        return "n/a"
    return "0" if s == 0 else (f"{s:.{digits}f}" if s >= 10**-digits else f"{s:.2g}")


def _pm(iv: dict, digits: int) -> str:
    """mean ± SE (rule v3) of an `over_seeds` interval, n/a with one seed."""
    return f"{iv['mean']:+.{digits}f} ± {_spread(iv['se'], digits)}"


def _fmt(values, digits: int = 3) -> str:
    m, s = _mean_std(_finite(values))
    return "n/a" if not math.isfinite(m) else f"{m:.{digits}f} ± {_spread(s, digits)}"


def _claims(runs: dict, entropy, per_run: dict, final: dict, gains: dict) -> dict:
    """Rule v3's verdicts of (a)-(d), each comparison with its headroom-normalised differences."""

    def growth_parts(b_arm: str, refs: tuple[str, ...], claim: str) -> dict:
        out = {}
        for a in (r for r in refs if r in runs and b_arm in runs):
            part = judge_growth(b_arm, a, paired(runs, b_arm, a), claim=claim)
            h = headroom(per_run, gains, b_arm, a)
            primary = part.get("slope", {}).get("mean", float("nan"))
            out[f"{b_arm}_vs_{a}"] = {**part, "headroom": h, "text": f"{part['text']}. {_headroom_text(h, primary)}"}
        return out

    def accuracy_parts(b_arm: str, refs: tuple[str, ...]) -> dict:
        out = {}
        for a in (r for r in refs if r in final and b_arm in final):
            part = judge_accuracy(a, final[a], b_arm, final[b_arm], paired_test=mcnemar(runs, b_arm, a))
            h = headroom(per_run, gains, b_arm, a)
            primary = part.get("welch", {}).get("diff", float("nan"))
            out[f"{b_arm}_vs_{a}"] = {**part, "headroom": h, "text": f"{part['text']}. {_headroom_text(h, primary)}"}
        return out

    return {
        "a": claim_a(entropy),
        "b": _claim(growth_parts("nvfp4", ("bf16", "bf16_lr5e-6"), "b")),
        "c": _claim(growth_parts("nvfp4_aqn", ("nvfp4",), "c")),
        "d": _claim(accuracy_parts("nvfp4_aqn", ("bf16", "bf16_lr5e-6"))),
    }


def _claims_by_rule(runs: dict, slopes: dict, final: dict) -> dict[str, dict[str, str]]:
    """The verdicts of (b)-(d) under the earlier rules v1 and v2 (PROTOCOL.md's history)."""

    def over(b: str, refs: tuple[str, ...], verdict) -> str:
        present = [a for a in refs if a in runs]
        return combine([verdict(b, a) for a in present]) if b in runs and present else "not measured"

    def v1(values: dict, strict: bool):
        return lambda b, a: verdict_v1(values[a], values[b], strict=strict)

    def v2(b: str, a: str) -> str:
        return judge_paired(b, a, paired(runs, b, a), what="reward")["verdict"]

    refs = ("bf16", "bf16_lr5e-6")
    d = over("nvfp4_aqn", refs, v1(final, False))  # v2 kept v1's rule for (d)
    return {
        "v1": {"b": over("nvfp4", refs, v1(slopes, False)), "c": over("nvfp4_aqn", ("nvfp4",), v1(slopes, True)), "d": d},
        "v2": {"b": over("nvfp4", refs, v2), "c": over("nvfp4_aqn", ("nvfp4",), v2), "d": d},
    }


def _arms(runs: dict, per_run: dict, base_evals: dict, n_common: int, steps: int, threshold: float):
    """(summary.json's arms, the per-arm table's lines)."""
    specs = _arm_specs()
    arms_out, table = {}, [
        "| arm | seeds (common steps) | reward, first 10% → last 20% | slope / 100 steps | relative growth "
        f"| headroom gain | steps to reward {threshold:.3f} (reached) | truncated | sampled-token entropy, first → last "
        "| greedy GSM8K, before → after (by seed) | greedy headroom gain | MATH500 after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, arm_runs in runs.items():
        s, spec = list(per_run[arm].values()), specs[arm]
        trunc = _finite(float(np.nanmean(r["curves"]["truncated"][:n_common])) for r in arm_runs.values())
        ent = lambda sl, arm_runs=arm_runs: [float(np.nanmean(r["curves"]["entropy_sampler"][sl])) for r in arm_runs.values()]  # noqa: E731
        reached = [x["steps_to_threshold"] for x in s if x["steps_to_threshold"] is not None]
        n_after = [r["after"].get(GSM8K, {}).get("n") for r in arm_runs.values() if r["after"]]
        b = base_evals[spec["quant"]].get(GSM8K, {}).get("pass_at_1")
        after = [r["after"].get(GSM8K, {}).get("pass_at_1") for r in arm_runs.values()]
        gains = [(x - b) / (1 - b) if x is not None and b is not None else None for x in after]
        arms_out[arm] = {
            "quant": spec["quant"],
            "lr": spec["lr"],
            "aqn": bool(spec["aqn"]),
            "seeds": sorted(arm_runs),
            "steps": min(r["steps"] for r in arm_runs.values()),
            "eval_before": {"gsm8k_test": b, "n": base_evals[spec["quant"]].get(GSM8K, {}).get("n")},
            "eval_after": {
                "gsm8k_test": after,
                "n": n_after[0] if n_after else None,
                "math500_test": [r["after"].get(MATH500, {}).get("pass_at_1") for r in arm_runs.values()],
                "per_problem_kept": [r.get("problems") is not None for r in arm_runs.values()],
            },
            "reward_slope_per_100": [x["slope_per_100"] for x in s],
            "truncated_frac": float(np.mean(trunc)) if trunc else None,
            "relative_growth": [x["relative_growth"] for x in s],
            "reward_headroom_gain": [x["headroom_gain"] for x in s],
            "greedy_headroom_gain": gains,
            "steps_to_threshold": [x["steps_to_threshold"] for x in s],
        }
        by_seed = ", ".join(f"{x:.3f}" for x in _finite(after))
        table.append(
            f"| {LABELS.get(arm, arm)} | {len(s)} ({n_common}/{steps}, {len(n_after)} evaluated) "
            f"| {_fmt([x['first'] for x in s])} → {_fmt([x['last'] for x in s])} | {_fmt(arms_out[arm]['reward_slope_per_100'], 4)} "
            f"| {_fmt([x['relative_growth'] for x in s], 2)} | {_fmt([x['headroom_gain'] for x in s], 3)} "
            f"| {_fmt(reached, 0) if reached else 'never'} ({len(reached)}/{len(s)}) "
            f"| {_fmt(trunc, 3)} | {_fmt(ent(slice(0, max(1, n_common // 10))))} → "
            f"{_fmt(ent(slice(n_common - max(1, n_common // 5), n_common)))} "
            f"| {'n/a' if b is None else f'{b:.3f}'} → {_fmt(after)} ({by_seed}) | {_fmt(gains, 3)} "
            f"| {_fmt(arms_out[arm]['eval_after']['math500_test'])} |"
        )
    return arms_out, table


def _paired_table(runs: dict) -> tuple[dict, list[str]]:
    paired_table = {
        f"{b}_minus_{a}": {key: paired(runs, b, a, key) for key in ("reward", "entropy_sampler")}
        for b, a in PAIRS
        if a in runs and b in runs
    }
    lines = [
        "| b minus a (same seed, same step) | seeds (steps) | reward level | reward slope / 100 steps, by seed "
        "| reward slope / 100 steps, 95% interval | sampled-token entropy level |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, d in paired_table.items():
        r, e = d["reward"], d["entropy_sampler"]
        if r is None:
            continue
        iv = r["slope"]
        interval = f"{iv['lo']:+.3f} .. {iv['hi']:+.3f}" if math.isfinite(iv["lo"]) else "n/a (one seed)"
        lines.append(
            f"| {name.replace('_minus_', ' - ')} | {r['seeds']} ({r['steps_per_seed']}) "
            f"| {_pm(r['level'], 4)} | {', '.join(f'{v:+.4f}' for v in r['slope_per_seed'])} "
            f"| {_pm(iv, 4)}: {interval} | {_pm(e['level'], 4)} |"
        )
    return paired_table, lines


def _claim_lines(claims: dict, key: str, title: str) -> list[str]:
    c = claims[key]
    if "parts" not in c:
        return [f"- **({key}) {title}: {c['verdict']}.** {c.get('text', '')}"]
    lines = [f"- **({key}) {title}: {c['verdict']}.**"]
    for name, p in c["parts"].items():
        reason = f" ({p['reason']})" if "reason" in p else ""
        lines.append(f"  - {name}: {p['verdict']}{reason}. {p['text']}")
    return lines


TITLES = {
    "a": "NVFP4 samples with higher entropy than bf16 before training",
    "b": f"NVFP4 LoRA's reward grows at least as fast as bf16 LoRA's (non-inferiority, margin {MARGINS['b']:g} per 100 steps)",
    "c": f"AQN adds to (b) (superiority, or equivalence within ±{MARGINS['c']:g} per 100 steps)",
    "d": f"QeRL's final greedy GSM8K accuracy >= bf16 LoRA's (non-inferiority, margin {MARGINS['d']:g})",
}


def _rules_lines(claims: dict, by_rule: dict) -> list[str]:
    lines = [
        "| claim | rule v1 (`93290ae`, before any run) | rule v2 (`737aa51`/`2ba80e7`, with the 50-step data) "
        "| rule v3 (PROTOCOL.md, after these data) |",
        "| --- | --- | --- | --- |",
    ]
    for key in ("b", "c", "d"):
        lines.append(f"| ({key}) | {by_rule['v1'][key]} | {by_rule['v2'][key]} | **{claims[key]['verdict']}** |")
    return lines


def _base_math500_text(results: str) -> str:
    """The bases' MATH500 (measured after the runs, `base_math500/<quant>/summary.json`), if there."""
    scores = {}
    for quant in ("bf16", "nvfp4"):
        path = os.path.join(results, "base_math500", quant, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                scores[quant] = json.load(f)["metrics"]["math500_test/pass_at_1"]
    if not scores:
        return "No MATH500 was measured before training."
    measured = ", ".join(f"{q} {100 * v:.1f}%" for q, v in scores.items())
    return f"MATH500 of the base models, measured after the runs (`base_math500/`): {measured}."


def _results_md(exp, steps, n_common, gpu_minutes, table, threshold, window, paired_lines, claims, by_rule, commands, out, results):
    return [
        "# Qwen2.5-Coder-1.5B-Instruct on GSM8K: results",
        "",
        f"**Limits first:** one model (Qwen2.5-Coder-1.5B-Instruct), its {BASE_NOTE}, and {steps} steps of DAPO + LoRA "
        "per run (the paper ran about 600; AQN's stages are correspondingly short): every verdict below holds for "
        f"that and no more. Verdicts by {PROTOCOL}; those of the earlier rules are in the last table.",
        "",
        f"`configs/gsm8k_claims.py`, model {exp.get('gguf')} (sha256 {exp.get('sha256')}). Per-step numbers use "
        f"the first {n_common} steps, which every run reached. GPU minutes: {gpu_minutes:.1f} "
        "(`calls.jsonl`: the launcher's calls and the device time noted beside them).",
        "",
        "![curves](qwen_gsm8k.png)",
        "",
        *table,
        "",
        f"Threshold: the mean first-10% reward over all runs + {THRESHOLD_GAIN} = {threshold:.3f}, reached by the "
        f"trailing moving average of {window} steps. Relative growth: last-20% mean / first-10% mean - 1. Headroom "
        "gain: (last-20% - first-10%) / (1 - first-10%) of the reward; greedy: (after - before) / (1 - before). "
        + _base_math500_text(results),
        "",
        "## Paired differences",
        "",
        "Runs of one seed sample the same prompts at each step whatever the arm. Per seed both arms ran: "
        "the difference's mean and OLS slope over the steps both reached. Over seeds: mean ± SE, the SE from the "
        "larger of the between-seed spread and the runs' own within-run error (PROTOCOL.md), 95% interval with t(n - 1).",
        "",
        *paired_lines,
        "",
        "## Claims (rule v3)",
        "",
        *(line for key in "abcd" for line in _claim_lines(claims, key, TITLES[key])),
        "",
        "## The same data under each rule",
        "",
        *_rules_lines(claims, by_rule),
        "",
        "## Commands",
        "",
        "```",
        commands,
        f"python -m experiments.qwen_gsm8k.run --summarize --out {out} --results {results}",
        "```",
        "",
    ]


def summarize(out: str, results: str) -> dict:
    exp, runs, entropy = read_experiment(out, results, load_runs)
    steps = exp["steps"]
    base_evals = {q: _eval(os.path.join(out, "base", q, "summary.json")) for q in ("bf16", "nvfp4")}
    before = {q: e.get(GSM8K, {}).get("pass_at_1") for q, e in base_evals.items()}
    n_common = min(r["steps"] for arm_runs in runs.values() for r in arm_runs.values())
    window = max(1, n_common // 20)
    starts = [np.nanmean(r["curves"]["reward"][: max(1, n_common // 10)]) for a in runs.values() for r in a.values()]
    threshold = float(np.nanmean(starts)) + THRESHOLD_GAIN
    per_run = {
        arm: {seed: growth(r["curves"]["reward"][:n_common], threshold, window) for seed, r in arm_runs.items()}
        for arm, arm_runs in runs.items()
    }
    arms_out, table = _arms(runs, per_run, base_evals, n_common, steps, threshold)
    slopes = {arm: v["reward_slope_per_100"] for arm, v in arms_out.items()}
    final = {arm: v["eval_after"]["gsm8k_test"] for arm, v in arms_out.items()}
    gains = {arm: v["greedy_headroom_gain"] for arm, v in arms_out.items()}
    claims = _claims(runs, entropy, per_run, final, gains)
    by_rule = _claims_by_rule(runs, slopes, final)
    paired_table, paired_lines = _paired_table(runs)
    gpu_minutes = _gpu_minutes(out)
    summary = {
        "model": {"name": MODEL_NAME, "sha256": exp.get("sha256"), "gguf": exp.get("gguf"), "base": BASE_NOTE},
        "task": "gsm8k",
        "protocol": PROTOCOL,
        "margins": MARGINS,
        "arms": arms_out,
        "claims": claims,
        "claims_by_rule": by_rule,
        "gpu_minutes": gpu_minutes,
        "common_steps": n_common,
        "paired": paired_table,
        "threshold": {"reward": threshold, "gain": THRESHOLD_GAIN, "window": window},
    }
    plot(runs, before, steps, n_common, os.path.join(results, "qwen_gsm8k.png"))
    commands_file = os.path.join(out, "commands.txt")
    commands = open(commands_file).read().strip() if os.path.isfile(commands_file) else ""
    lines = _results_md(
        exp, steps, n_common, gpu_minutes, table, threshold, window, paired_lines, claims, by_rule, commands, out, results
    )
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
