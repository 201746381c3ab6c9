"""The dose-response's wall time, projected from the steps its runs have measured so far.

  python -m experiments.aqn_dose.plan --out /tmp/ad [--gpus 4 --per-gpu 2 --runs 8 --steps 180]

Reads every <out>/runs/<arm>/seed<k>/tensorboard/scalars.jsonl (`time/step_s` of each train step),
prints each run's steps, first step and median later step, and projects: the minutes until the
slowest run ends (its remaining steps at its median step, plus the final evaluation) and the
minutes the whole design takes on a fresh machine with --gpus x --per-gpu processes at once.
The median step is only valid for the number of processes per GPU it was measured with.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics


def measured(out: str) -> dict[str, dict]:
    """run -> {"steps", "first_s", "step_s"} from the runs' scalars (train steps only)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "runs", "*", "seed*", "tensorboard", "scalars.jsonl"))):
        rows = {}
        for line in open(path):
            if line.strip():
                row = json.loads(line)
                if "aqn/sigma" in row and "time/step_s" in row:
                    rows[row["step"]] = row["time/step_s"]
        if rows:
            times = [rows[s] for s in sorted(rows)]
            run = "/".join(path.split(os.sep)[-4:-2])
            found[run] = {"steps": max(rows) + 1, "first_s": times[0], "step_s": statistics.median(times[1:] or times)}
    return found


def project_minutes(step_s: float, first_s: float, steps: int, runs: int, gpus: int, per_gpu: int, eval_minutes: float) -> float:
    """Wall minutes of `runs` runs of `steps` steps, gpus x per_gpu at once, each wave compiling
    (first step), stepping at `step_s` and evaluating."""
    waves = math.ceil(runs / (gpus * per_gpu))
    return waves * ((first_s + (steps - 1) * step_s) / 60 + eval_minutes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--per-gpu", type=int, default=2, help="processes per GPU, as measured")
    p.add_argument("--runs", type=int, default=8, help="runs in the design (4 arms x 2 seeds)")
    p.add_argument("--steps", type=int, default=180)
    p.add_argument("--eval-minutes", type=float, default=2.0)
    args = p.parse_args(argv)
    runs = measured(args.out)
    if not runs:
        print(f"error: {args.out}/runs holds no train step with time/step_s yet", flush=True)
        return 2
    for run, m in runs.items():
        print(f"{run}: {m['steps']} steps, first {m['first_s']:.1f} s, then median {m['step_s']:.2f} s")
    step_s = max(m["step_s"] for m in runs.values())  # the slowest run sets the wall time
    first_s = max(m["first_s"] for m in runs.values())
    left = max((args.steps - m["steps"]) * m["step_s"] for m in runs.values()) / 60 + args.eval_minutes
    whole = project_minutes(step_s, first_s, args.steps, args.runs, args.gpus, args.per_gpu, args.eval_minutes)
    print(f"until the slowest run is evaluated: {left:.1f} min")
    print(f"the whole design ({args.runs} runs x {args.steps} steps, {args.gpus} GPUs x {args.per_gpu}): {whole:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
