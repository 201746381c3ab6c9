"""The verdicts of PROTOCOL.md: partial rollouts (arm b: K = 1 in rules v1, K = 2 with the decoupled
objective in rules v2, the same rules) against the on-policy step (arm a).

    python -m experiments.partial_rollouts.summarize [--rules v2] --run a 0 RUN_A0 --run b 0 RUN_B0 \\
        --run a 1 RUN_A1 --run b 1 RUN_B1 --out summary.json

RUN is a run's workdir: its `tensorboard/scalars.jsonl` gives the per-step metrics. Its final greedy
evaluation is `--eval ARM SEED SUMMARY_JSON` (the eval command's summary.json; the per-problem file
beside it, where kept, gives the McNemar test), or missing: then rule 3 is "no data".
"""

from __future__ import annotations

import numpy as np

from experiments import stats
from experiments.paired_runs import (
    accuracy_verdict,
    arms_parser,
    common_steps,
    mean_logged,
    paired_difference,
    read_arms,
    series,
    write_summary,
)

PROTOCOL = "experiments/partial_rollouts/PROTOCOL.md, rules {}"
RULES = ("v1", "v2")  # v2 judges arm b = K = 2 with rl.old_logp_source=proximal by v1's rules
SPEED_STEPS = (1, 39)  # rule 1: step 0 holds the first compilation
CURVE_STEPS = (10, 39)  # rule 2: after arm b's off-policy share settles
STEP_TARGET, ROLLOUT_TARGET = 0.70, 0.60
REWARD_MARGIN = 0.03
ACCURACY_MARGIN = 0.01  # 1 point of pass@1
REPORTED = ("rollout/offpolicy_tokens_frac", "rollout/staleness_max", "rollout/carried_groups",
            "rollout/forced_groups", "rollout/response_length_p10", "rollout/response_length_p50",
            "rollout/response_length_p90", "rollout/tokens_per_s", "rollout/decoded_tokens", "rollout/decode_steps",
            "time/rollout_loop_host_s", "time/rollout_loop_device_s", "rollout/resumed_tokens",
            "rollout/rows_per_decode_step")  # fmt: skip


def speed(a: dict[int, dict], b: dict[int, dict]) -> dict[str, float]:
    """Rule 1 for one seed: b's mean step and rollout + reward time over a's, on the common steps."""
    steps = common_steps(a, b, *SPEED_STEPS)
    rollout = lambda rows: series(rows, steps, "time/rollout_s") + series(rows, steps, "time/reward_s")  # noqa: E731
    return {
        "steps": len(steps),
        "step_ratio": float(series(b, steps, "time/step_s").mean() / series(a, steps, "time/step_s").mean()),
        "rollout_ratio": float(rollout(b).mean() / rollout(a).mean()),
    }


def reward_difference(a: dict[int, dict], b: dict[int, dict]) -> dict[str, float]:
    """Rule 2 for one seed: the mean of the paired `reward/mean_sampled` difference b - a and its SE."""
    return paired_difference(a, b, "reward/mean_sampled", *CURVE_STEPS)


def _speed_verdict(per_seed: list[dict]) -> dict:
    step = float(np.mean([s["step_ratio"] for s in per_seed]))
    rollout = float(np.mean([s["rollout_ratio"] for s in per_seed]))
    met = step <= STEP_TARGET and rollout <= ROLLOUT_TARGET
    every = all(s["step_ratio"] <= STEP_TARGET and s["rollout_ratio"] <= ROLLOUT_TARGET for s in per_seed)
    verdict = "met" if met and every else ("met on the mean, not in every seed" if met else "missed")
    return {"step_ratio": step, "rollout_ratio": rollout, "verdict": verdict}


def summarize(
    runs: dict[tuple[str, int], dict[int, dict]], evals: dict[tuple[str, int], dict], rules: str = "v1"
) -> dict:
    """The protocol's verdicts from each (arm, seed)'s steps (`read_steps`) and final evaluation ({"pass_at_1",
    optional "problems"}); seeds where both arms ran."""
    seeds = sorted(s for arm, s in runs if arm == "a" and ("b", s) in runs)
    speeds = [speed(runs["a", s], runs["b", s]) for s in seeds]
    rewards = [reward_difference(runs["a", s], runs["b", s]) for s in seeds]
    over = stats.over_seeds([r["value"] for r in rewards], [r["se"] for r in rewards])
    reported = {
        f"{arm}{s}": {tag: mean_logged(rows, tag) for tag in REPORTED} for (arm, s), rows in sorted(runs.items())
    }
    return {
        "protocol": PROTOCOL.format(rules),
        "seeds": seeds,
        "speed": {"per_seed": speeds, **(_speed_verdict(speeds) if speeds else {"verdict": "no data"})},
        "reward": {
            "per_seed": rewards,
            "over_seeds": over,
            "verdict": stats.non_inferior(over["lo"], over["hi"], REWARD_MARGIN),
        },
        "accuracy": accuracy_verdict(evals, seeds, ACCURACY_MARGIN),
        "reported_means": reported,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = arms_parser(__doc__)
    parser.add_argument("--rules", default="v1", help=f"the rule set of PROTOCOL.md judging arm b: {', '.join(RULES)}")
    args = parser.parse_args(argv)
    if args.rules not in RULES:
        parser.exit(2, f"error: --rules must be one of {', '.join(RULES)}; got {args.rules!r}\n")
    runs, evals = read_arms(parser, args, ("on-policy", "partial rollouts"))
    out = summarize(runs, evals, args.rules)
    write_summary(out, args.out, ("speed", "reward", "accuracy"))
    return out


if __name__ == "__main__":
    main()
