"""Two arms of a pre-registered experiment, run per seed: their per-step scalars and final evaluations,
paired the way the protocols' rules read them (`experiments/partial_rollouts`, `experiments/fp8_reward`)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from experiments import stats
from experiments.fidelity.summarize import _pass_at_1
from experiments.qwen_gsm8k.summarize import PROBLEMS_FILE, mcnemar, read_problems
from qerl_jax.metrics import SCALARS_JSONL


def scalars_file(workdir: str) -> str:
    return os.path.join(workdir, "tensorboard", SCALARS_JSONL)


def read_steps(workdir: str) -> dict[int, dict]:
    """step -> the train step's scalars (a resumed run's repeated steps: the last wins)."""
    rows = {}
    with open(scalars_file(workdir)) as f:
        for line in f:
            row = json.loads(line) if line.strip() else {}
            if "time/step_s" in row:  # a train step (evaluations log eval/* only)
                rows[int(row["step"])] = row
    return rows


def series(rows: dict[int, dict], steps: list[int], tag: str) -> np.ndarray:
    """`tag` at each of `steps` (NaN where a step did not log it)."""
    return np.array([rows[s].get(tag, np.nan) for s in steps], np.float64)


def common_steps(a: dict[int, dict], b: dict[int, dict], first: int, last: int) -> list[int]:
    """The steps in [first, last] both runs reached."""
    return sorted(s for s in a.keys() & b.keys() if first <= s <= last)


def paired_difference(a: dict[int, dict], b: dict[int, dict], tag: str, first: int, last: int) -> dict[str, float]:
    """The mean of the per-step difference b - a of `tag` over the common steps in [first, last], and its
    within-run SE (`stats.mean_within`)."""
    steps = common_steps(a, b, first, last)
    return {"steps": len(steps), **stats.mean_within(series(b, steps, tag) - series(a, steps, tag))}


def mean_logged(rows: dict[int, dict], tag: str, first: int = 0, last: int | None = None) -> float | None:
    """The mean of `tag` over the steps in [first, last] that logged it (None: none did)."""
    values = [row[tag] for s, row in rows.items() if tag in row and first <= s and (last is None or s <= last)]
    return float(np.mean(values)) if values else None


def read_eval(summary_file: str) -> dict:
    """An evaluation's {"pass_at_1", and "problems" where its per-problem file was kept}."""
    out = {"pass_at_1": _pass_at_1(summary_file)}
    problems = read_problems(os.path.join(os.path.dirname(summary_file), PROBLEMS_FILE))
    return out if problems is None else {**out, "problems": problems}


def accuracy_verdict(evals: dict[tuple[str, int], dict], seeds: list[int], margin: float) -> dict:
    """b - a of the final pass@1, mean over the seeds both arms evaluated: "met" if >= -margin (on the
    point estimate), with the Welch interval and the McNemar test on the problems."""
    paired = [s for s in seeds if ("a", s) in evals and ("b", s) in evals]
    if not paired:
        return {"verdict": "no data"}
    a = [evals["a", s]["pass_at_1"] for s in paired]
    b = [evals["b", s]["pass_at_1"] for s in paired]
    diff = float(np.mean(b) - np.mean(a))
    problems = {arm: {s: {"problems": evals[arm, s].get("problems")} for s in paired} for arm in "ab"}
    return {
        "seeds": paired,
        "diff": diff,
        "welch": stats.welch(a, b),
        "mcnemar": mcnemar(problems, "b", "a"),
        "verdict": "met" if diff >= -margin else "missed",
    }


def arms_parser(doc: str) -> argparse.ArgumentParser:
    """A summary command's parser: `--run ARM SEED WORKDIR`, `--eval ARM SEED SUMMARY_JSON` (repeated), `--out`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs=3, action="append", default=[], metavar=("ARM", "SEED", "WORKDIR"))
    parser.add_argument("--eval", nargs=3, action="append", default=[], metavar=("ARM", "SEED", "SUMMARY_JSON"))
    parser.add_argument("--out", default="")
    return parser


def read_arms(
    parser: argparse.ArgumentParser, args: argparse.Namespace, arm_names: tuple[str, str], more_files: tuple = ()
) -> tuple[dict[tuple[str, int], dict[int, dict]], dict[tuple[str, int], dict]]:
    """({(arm, seed): its steps}, {(arm, seed): its evaluation}) of `arms_parser`'s arguments; a bad arm or seed,
    or a file missing (theirs or `more_files`), ends the command with one line and exit 2 before any is read.
    arm_names: what arms a and b are, for that line."""
    for arm, seed, _ in args.run + args.eval:
        if arm not in ("a", "b") or not seed.isdigit():
            parser.exit(2, f"error: --run/--eval ARM SEED: ARM must be a ({arm_names[0]}) or b ({arm_names[1]}) and "
                           f"SEED a number; got {arm!r} {seed!r}\n")  # fmt: skip
    files = [scalars_file(w) for _, _, w in args.run] + [p for _, _, p in args.eval] + list(more_files)
    for path in files:
        if not os.path.isfile(path):
            parser.exit(2, f"error: {path} does not exist (a run's workdir, an evaluation's summary.json)\n")
    runs = {(arm, int(seed)): read_steps(workdir) for arm, seed, workdir in args.run}
    return runs, {(arm, int(seed)): read_eval(path) for arm, seed, path in args.eval}


def write_summary(out: dict, path: str, rules: tuple[str, ...]) -> None:
    """Writes the summary as JSON to `path` (if any) and prints each rule's verdict on one line."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(out, indent=1, default=lambda x: sorted(x) if isinstance(x, set) else str(x)) + "\n")
    print("; ".join(f"{rule}: {out[rule]['verdict']}" for rule in rules))
