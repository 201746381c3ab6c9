"""The verdicts of PROTOCOL.md (rules v1): training with FP8 matmuls (arm b) against the bf16-activation
path (arm a), real 1.5B recipe.

    python -m experiments.fp8_reward.summarize --run a 0 RUN_A0 --run b 0 RUN_B0 \\
        --run a 1 RUN_A1 --run b 1 RUN_B1 --eval a 0 EVAL_A0/summary.json ... \\
        --fp8-eval 0 EVAL_B0_FP8/summary.json ... --out summary.json

RUN is a run's workdir (its `tensorboard/scalars.jsonl`). `--eval ARM SEED SUMMARY_JSON`: the final adapter's
greedy evaluation with fp8_matmul=off (rule 2; the per-problem file beside it, where kept, gives the
McNemar test); `--fp8-eval SEED SUMMARY_JSON`: arm b's adapter evaluated with fp8_matmul=on (reported).
"""

from __future__ import annotations

from experiments import stats
from experiments.paired_runs import (
    accuracy_verdict,
    arms_parser,
    common_steps,
    mean_logged,
    paired_difference,
    read_arms,
    read_eval,
    series,
    write_summary,
)

PROTOCOL = "experiments/fp8_reward/PROTOCOL.md, rules v1"
CURVE_STEPS = (0, 39)  # rule 1: both arms draw the same prompts from step 0; nothing settles
REPORT_STEPS = (1, 39)  # step 0 compiles
REWARD_MARGIN = 0.03
ACCURACY_MARGIN = 0.01  # 1 point of pass@1
TIMES = ("time/step_s", "time/rollout_s", "time/train_s")
REPORTED = (*TIMES, "train/sampler_kl", "train/sampler_abs_log_ratio", "train/clip_frac", "train/ratio_max",
            "rollout/response_length_mean")  # fmt: skip


def time_ratios(a: dict[int, dict], b: dict[int, dict]) -> dict[str, float]:
    """b's mean of each time over a's, on the steps 1-39 both reached."""
    steps = common_steps(a, b, *REPORT_STEPS)
    return {"steps": len(steps), **{t: float(series(b, steps, t).mean() / series(a, steps, t).mean()) for t in TIMES}}


def summarize(runs: dict[tuple[str, int], dict[int, dict]], evals: dict[tuple[str, int], dict],
              fp8_evals: dict[int, dict] | None = None) -> dict:  # fmt: skip
    """The protocol's verdicts from each (arm, seed)'s steps (`read_steps`) and final evaluations
    ({"pass_at_1", optional "problems"}); seeds where both arms ran."""
    seeds = sorted(s for arm, s in runs if arm == "a" and ("b", s) in runs)
    rewards = [paired_difference(runs["a", s], runs["b", s], "reward/mean_sampled", *CURVE_STEPS) for s in seeds]
    over = stats.over_seeds([r["value"] for r in rewards], [r["se"] for r in rewards])
    return {
        "protocol": PROTOCOL,
        "seeds": seeds,
        "reward": {
            "per_seed": rewards,
            "over_seeds": over,
            "verdict": stats.non_inferior(over["lo"], over["hi"], REWARD_MARGIN) if seeds else "no data",
        },
        "accuracy": accuracy_verdict(evals, seeds, ACCURACY_MARGIN),
        "time_ratios": {s: time_ratios(runs["a", s], runs["b", s]) for s in seeds},
        "reported_means": {
            f"{arm}{s}": {tag: mean_logged(rows, tag, *REPORT_STEPS) for tag in REPORTED}
            for (arm, s), rows in sorted(runs.items())
        },
        "b_with_fp8_eval": {s: e["pass_at_1"] for s, e in sorted((fp8_evals or {}).items())},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = arms_parser(__doc__)
    parser.add_argument("--fp8-eval", nargs=2, action="append", default=[], metavar=("SEED", "SUMMARY_JSON"))
    args = parser.parse_args(argv)
    for seed, _ in args.fp8_eval:
        if not seed.isdigit():
            parser.exit(2, f"error: --fp8-eval SEED: SEED must be a number; got {seed!r}\n")
    runs, evals = read_arms(parser, args, ("fp8_matmul=off", "fp8_matmul=on"), tuple(p for _, p in args.fp8_eval))
    out = summarize(runs, evals, {int(seed): read_eval(path) for seed, path in args.fp8_eval})
    write_summary(out, args.out, ("reward", "accuracy"))
    return out


if __name__ == "__main__":
    main()
