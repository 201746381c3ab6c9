"""The AQN dose-response's summary by its pre-registered analysis (experiments/qwen_gsm8k/PROTOCOL.md,
section 3): results.md, summary.json, aqn_dose.png.

  python -m experiments.aqn_dose.run --summarize --out ad --results experiments/aqn_dose/results

Each arm against the control `sigma0`, same seed, per AQN stage (the config's stages over the run's
steps): the paired stage-mean difference of the sampler/train KL, the sampled-token entropy and the
reward (`stats.mean_within` per seed, `stats.over_seeds` over seeds); the whole run's paired reward
slope (superiority or equivalence within MARGIN); the final greedy GSM8K accuracy (Welch, the exact
McNemar test per seed and pooled over seeds). Stage 0, where every arm is at its sigma_start,
decides; stages 1-2 are description. `<out>/noise_kl.json` (experiments/qwen_gsm8k/noise_kl.py), if
there, gives the next-token KL each stage's sigma adds on the model.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments import stats
from experiments.fidelity.summarize import _jsonl_curves, _smooth, read_experiment
from experiments.qwen_gsm8k.summarize import (
    GSM8K,
    PROBLEMS_FILE,
    _eval,
    _finite_or_none,
    mcnemar,
    paired,
    read_problems,
)

CONTROL = "sigma0"
MARGIN = 0.010  # reward per 100 steps (PROTOCOL.md: (c)'s margin)
SUFFER_POINTS = 0.010  # greedy accuracy
ALPHA = 0.05
TAGS = {
    "reward": "reward/mean_sampled",
    "entropy": "rollout/entropy_mc",
    "sampler_kl": "train/sampler_kl",
    "sigma": "aqn/sigma",
    "truncated": "rollout/truncated_frac",
}
MEASURES = {"sampler_kl": "sampler/train KL", "entropy": "sampled-token entropy", "reward": "reward level"}


def _config():
    from configs import aqn_dose  # noqa: PLC0415

    return aqn_dose


def load_runs(out: str, steps: int) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for arm in _config().ARMS:
        arm_dir = os.path.join(out, "runs", arm)
        for name in sorted(os.listdir(arm_dir)) if os.path.isdir(arm_dir) else []:
            jsonl = os.path.join(arm_dir, name, "tensorboard", "scalars.jsonl")
            if name.startswith("seed") and os.path.isfile(jsonl):
                curves = _jsonl_curves(jsonl, TAGS)
                eval_dir = os.path.join(arm_dir, name, "eval", f"step_{steps}")
                runs.setdefault(arm, {})[int(name[4:])] = {
                    "curves": curves,
                    "steps": len(curves["reward"]),
                    "accuracy": _eval(os.path.join(eval_dir, "summary.json")).get(GSM8K, {}).get("pass_at_1"),
                    "problems": read_problems(os.path.join(eval_dir, PROBLEMS_FILE)),
                }
    return runs


def stage_bounds(steps: int, stages: int) -> list[tuple[int, int]]:
    """[lo, hi) of each AQN stage: the steps t with floor(t * stages / steps) == k (`aqn.aqn_stage`)."""
    return [(-(-k * steps // stages), -(-(k + 1) * steps // stages)) for k in range(stages)]


def stage_sigmas(arm: str, stages: int) -> list[float]:
    cfg = _config()
    s = cfg.SIGMAS[arm]
    return [s / cfg.DECAY_RATIO ** (k / (stages - 1)) if stages > 1 else s for k in range(stages)]


def _interval(p: dict | None, what: str) -> dict:
    empty = {"n": 0, "mean": float("nan"), "se": float("nan"), "df": 0, "lo": float("nan"), "hi": float("nan")}
    return empty if p is None else {**p[what], "by_seed": p["level_per_seed" if what == "level" else "slope_per_seed"]}


def stage_table(runs: dict, arm: str, bounds: list[tuple[int, int]]) -> list[dict]:
    """Per stage: each measure's paired stage-mean difference (arm - control) and the KL ratio."""
    rows = []
    for lo, hi in bounds:
        row = {"steps": [lo, hi]}
        for key in MEASURES:
            row[key] = _interval(paired(runs, arm, CONTROL, key, start=lo, end=hi), "level")
        kl = lambda a, lo=lo, hi=hi: np.nanmean([np.nanmean(r["curves"]["sampler_kl"][lo:hi]) for r in runs[a].values()])  # noqa: E731
        row["sampler_kl_ratio"] = float(kl(arm) / kl(CONTROL))
        row["reward_slope"] = _interval(paired(runs, arm, CONTROL, "reward", start=lo, end=hi), "slope")
        rows.append(row)
    return rows


def accuracy(runs: dict, arm: str) -> dict:
    """Final greedy GSM8K of arm - control: Welch over seeds, per-seed and pooled exact McNemar."""
    acc = lambda a: {s: r["accuracy"] for s, r in runs.get(a, {}).items() if r["accuracy"] is not None}  # noqa: E731
    mine, ctrl = acc(arm), acc(CONTROL)
    shared = sorted(mine.keys() & ctrl.keys())
    per_seed = []
    for seed in shared:
        one = {a: {seed: runs[a][seed]} for a in (arm, CONTROL)}
        per_seed.append({"seed": seed, "diff": mine[seed] - ctrl[seed], "mcnemar": mcnemar(one, arm, CONTROL)})
    return {
        "welch": stats.welch(list(ctrl.values()), list(mine.values())),
        "per_seed": per_seed,
        "pooled_mcnemar": mcnemar(runs, arm, CONTROL),
    }


def accuracy_conditions(acc: dict) -> dict[str, bool]:
    """PROTOCOL.md's three conditions: the mean more than SUFFER_POINTS below the control, below it
    in every seed, and the pooled exact McNemar p < ALPHA."""
    w, seeds, pooled = acc["welch"], acc["per_seed"], acc["pooled_mcnemar"]
    return {
        "more than 1 point lower": bool(seeds and math.isfinite(w["diff"]) and w["diff"] < -SUFFER_POINTS),
        "lower in every seed": bool(seeds and all(s["diff"] < 0 for s in seeds)),
        f"pooled McNemar p < {ALPHA:g}": bool(pooled is not None and pooled["p"] < ALPHA),
    }


def suffers(acc: dict) -> bool:
    return all(accuracy_conditions(acc).values())


def _conditions_text(acc: dict) -> str:
    return "; ".join(f"{name}: {'yes' if met else 'no'}" for name, met in accuracy_conditions(acc).items())


def accuracy_threshold(by_arm: dict[str, dict], order: list[str]) -> dict:
    """The smallest sigma_start whose accuracy suffers; "non-monotone" if a larger one then does not.
    With none, the arms that meet some of the conditions are named, so a near miss reads as one."""
    hurt = [arm for arm in order if suffers(by_arm[arm])]
    if not hurt:
        near = [arm for arm in order if any(accuracy_conditions(by_arm[arm]).values())]
        text = "no sigma up to the largest lowered greedy accuracy by more than 1 point"
        if near:
            text += " by all three conditions (" + "; ".join(f"{arm}: {_conditions_text(by_arm[arm])}" for arm in near) + ")"
        return {"threshold": None, "text": text}
    first = order.index(hurt[0])
    if any(not suffers(by_arm[arm]) for arm in order[first:]):
        return {"threshold": None, "non_monotone": hurt, "text": f"non-monotone: {', '.join(hurt)} meet the rule, a larger sigma does not"}
    return {"threshold": hurt[0], "text": f"accuracy starts to suffer at {hurt[0]}"}


def readings(stage0: dict, growth: dict) -> dict[str, str]:
    """The decisions of stage 0 (sampler, exploration) and of the whole run's reward growth."""
    kl, ent = stage0["sampler_kl"], stage0["entropy"]
    if kl["n"] < 2:
        return {k: "inconclusive (one seed)" for k in ("sampler", "exploration", "growth")}
    sampler = "raises the sampler/train KL" if kl["lo"] > 0 else "no rise of the sampler/train KL shown"
    exploration = (
        "raises the sampled-token entropy" if ent["lo"] > 0 else "lowers the sampled-token entropy" if ent["hi"] < 0 else "no entropy change shown"
    )
    verdict, reading = stats.superior_or_equivalent(growth["lo"], growth["hi"], MARGIN)
    grow = {
        "above 0": "speeds reward growth",
        "below 0": "slows reward growth",
    }.get(reading, f"no effect on reward growth as large as ±{MARGIN:g}" if verdict == "not supported" else "inconclusive")
    return {"sampler": sampler, "exploration": exploration, "growth": grow}


def _answer(arms: dict[str, dict], order: list[str]) -> dict:
    """The smallest sigma_start at which each reading holds. The design needs two seeds in every arm
    (PROTOCOL.md, section 3); with fewer, every entry says so instead of naming an arm."""
    if any(len(arms[a]["seeds"]) < 2 for a in order):
        text = "no verdict: fewer than two seeds in some arm (the design needs two)"
        return {"sampler": text, "exploration": text, "growth": text, "accuracy": {"threshold": None, "text": text}}
    first = lambda key, phrase: next((a for a in order if arms[a]["readings"][key].startswith(phrase)), None)  # noqa: E731
    return {
        "sampler": first("sampler", "raises"),
        "exploration": next((a for a in order if not arms[a]["readings"]["exploration"].startswith("no ")), None),
        "growth": next((a for a in order if arms[a]["readings"]["growth"].endswith("reward growth")), None),
        "accuracy": accuracy_threshold({a: arms[a]["accuracy"] for a in order}, order),
    }


def doses(out: str, arm: str, stages: int) -> list[float | None]:
    """Next-token KL that each stage's sigma adds on top of NVFP4 (noise_kl.json), None where not measured."""
    path = os.path.join(out, "noise_kl.json")
    measured = json.load(open(path))["aqn"] if os.path.isfile(path) else {}
    found = []
    for sigma in stage_sigmas(arm, stages):
        hit = [v["kl_nvfp4_to_noised"] for k, v in measured.items() if sigma > 0 and math.isclose(float(k), sigma, rel_tol=1e-6)]
        found.append(hit[0] if hit else (0.0 if sigma == 0 else None))
    return found


# ----------------------------------------------------------------------------- output


def plot(runs: dict, bounds: list[tuple[int, int]], path: str) -> None:
    """Sampler/train KL per arm, and each arm's entropy and reward minus the control's (same seed, same step)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.6))
    n = min(r["steps"] for arm_runs in runs.values() for r in arm_runs.values())
    w = max(1, n // 30)
    for i, (arm, arm_runs) in enumerate(runs.items()):
        color = f"C{i}"
        kl = np.nanmean(np.stack([r["curves"]["sampler_kl"][:n] for r in arm_runs.values()]), 0)
        axes[0].plot(np.arange(n), _smooth(kl, w), color=color, label=f"{arm} ({len(arm_runs)} seeds)")
        if arm == CONTROL:
            continue
        for ax, key in ((axes[1], "entropy"), (axes[2], "reward")):
            seeds = [s for s in arm_runs if s in runs.get(CONTROL, {})]
            if seeds:
                d = np.stack([arm_runs[s]["curves"][key][:n] - runs[CONTROL][s]["curves"][key][:n] for s in seeds])
                ax.plot(np.arange(n), _smooth(np.nanmean(d, 0), 2 * w), color=color, label=arm)
    axes[0].set_yscale("log")
    for ax, label in zip(axes, ("sampler/train KL", "sampled-token entropy minus the control's", "reward minus the control's")):
        for lo, _ in bounds[1:]:
            ax.axvline(lo, color="k", lw=0.6, ls=":")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].axhline(0.0, color="k", lw=0.8)
    axes[2].axhline(0.0, color="k", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"AQN dose-response, Qwen2.5-Coder-1.5B-Instruct (NVFP4 from Q4_K_M), GSM8K: moving average of {w} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _iv(iv: dict, spec: str = "+.5f") -> str:
    """mean (95% interval), in the format `spec`."""
    if not iv["n"]:
        return "n/a"
    if iv["n"] < 2:
        return f"{iv['mean']:{spec}} (one seed)"
    return f"{iv['mean']:{spec}} ({iv['lo']:{spec}} .. {iv['hi']:{spec}})"


def _arm_lines(arm: str, a: dict) -> list[str]:
    lines = [f"### {arm} (sigma per stage: {', '.join(f'{s:g}' for s in a['stage_sigmas'])})", ""]
    lines += [
        "| stage (steps) | sigma | KL it adds on the model | sampler/train KL, minus the control's (ratio) "
        "| sampled-token entropy, minus the control's | reward level, minus the control's | reward slope / 100 steps, minus |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, row in enumerate(a["stages"]):
        dose = a["doses"][k]
        lines.append(
            f"| {k} ({row['steps'][0]}-{row['steps'][1] - 1}) | {a['stage_sigmas'][k]:g} | {'n/a' if dose is None else f'{dose:.2e}'} "
            f"| {_iv(row['sampler_kl'], '+.2e')} ({row['sampler_kl_ratio']:.2f}x) | {_iv(row['entropy'])} "
            f"| {_iv(row['reward'], '+.4f')} | {_iv(row['reward_slope'], '+.4f')} |"
        )
    acc, g = a["accuracy"], a["growth"]
    per_seed = ", ".join(
        f"seed {s['seed']} {s['diff']:+.4f}" + ("" if s["mcnemar"] is None else f" (McNemar p {s['mcnemar']['p']:.3g})")
        for s in acc["per_seed"]
    )
    pooled = acc["pooled_mcnemar"]
    w = acc["welch"]
    lines += [
        "",
        f"- Stage 0 decides: **{a['readings']['sampler']}; {a['readings']['exploration']}**.",
        f"- Reward growth over the whole run (paired slope minus the control's): {_iv(g, '+.4f')}: **{a['readings']['growth']}**.",
        f"- Final greedy GSM8K minus the control's: {w['diff']:+.4f} (Welch 95% {w['lo']:+.4f} .. {w['hi']:+.4f}"
        + ("; no spread between seeds, so no interval" if w["se"] == 0.0 else "")
        + f"); "
        f"{per_seed or 'no seed evaluated'}; pooled McNemar "
        + ("n/a" if pooled is None else f"{pooled['b_only']} vs {pooled['a_only']} discordant, p {pooled['p']:.3g}")
        + f": {'suffers' if a['suffers'] else 'does not meet the rule'} ({_conditions_text(acc)}).",
        "",
    ]
    return lines


def summarize(out: str, results: str) -> dict:
    exp, runs, _ = read_experiment(out, results, load_runs)
    if CONTROL not in runs:
        raise SystemExit(f"{out}/runs has no {CONTROL} run: every comparison is against the control")
    steps, stages = exp["steps"], _config().STAGES
    bounds = stage_bounds(steps, stages)
    order = [arm for arm in _config().ARMS if arm in runs and arm != CONTROL]
    arms = {}
    for arm in order:
        rows = stage_table(runs, arm, bounds)
        growth = _interval(paired(runs, arm, CONTROL, "reward"), "slope")
        arms[arm] = {
            "seeds": sorted(runs[arm]),
            "stage_sigmas": stage_sigmas(arm, stages),
            "doses": doses(out, arm, stages),
            "stages": rows,
            "growth": growth,
            "accuracy": accuracy(runs, arm),
            "readings": readings(rows[0], growth),
        }
        arms[arm]["suffers"] = suffers(arms[arm]["accuracy"])
    answer = _answer(arms, order)
    threshold = answer["accuracy"]
    summary = {"experiment": exp, "stage_bounds": bounds, "control": CONTROL, "margin": MARGIN, "arms": arms, "answer": answer}
    plot(runs, bounds, os.path.join(results, "aqn_dose.png"))
    ctrl_acc = [r["accuracy"] for r in runs[CONTROL].values() if r["accuracy"] is not None]
    lines = [
        "# AQN dose-response on Qwen2.5-Coder-1.5B-Instruct (NVFP4 re-quantized from Q4_K_M), GSM8K: results",
        "",
        f"One model, NVFP4 re-quantized from its Q4_K_M GGUF (round-to-nearest), {steps} steps per run, AQN in "
        f"{stages} stages with noise from step 0: every reading holds for that and no more. Analysis as "
        "pre-registered in `experiments/qwen_gsm8k/PROTOCOL.md` (section 3): each arm against the control "
        f"`{CONTROL}` (AQN off), same seed, same step; stage 0 decides. Model sha256 {exp.get('sha256')}, source "
        f"tree {str(exp.get('code'))[:12]}. Control's final greedy GSM8K: "
        + (", ".join(f"{x:.4f}" for x in ctrl_acc) or "not evaluated")
        + ".",
        "",
        "![curves](aqn_dose.png)",
        "",
        "**The answer.**",
        f"- The smallest sigma_start that raises the sampler/train KL in stage 0: {answer['sampler'] or 'none'}.",
        f"- That changes the sampled-token entropy in stage 0: {answer['exploration'] or 'none'}.",
        f"- That speeds or slows reward growth over the whole run: {answer['growth'] or 'none'}.",
        f"- Greedy accuracy: {threshold['text']}.",
        "- No correction for the three arms' multiplicity (pre-registered).",
        "",
        *(line for arm in order for line in _arm_lines(arm, arms[arm])),
    ]
    with open(os.path.join(results, "results.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(results, "summary.json"), "w") as f:
        json.dump(_finite_or_none(summary), f, indent=2)
    print("\n".join(lines))
    return summary
