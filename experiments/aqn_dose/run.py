"""The AQN dose-response on Qwen2.5-Coder-1.5B-Instruct, GSM8K (README.md here; the pre-registered
analysis: experiments/qwen_gsm8k/PROTOCOL.md, section 3).

Train (one or more processes per GPU; each (arm, seed) a process of the real loop, side by side):
  python -m experiments.aqn_dose.run --gguf /tmp/q15.gguf --out /tmp/ad --seeds 0 1 --gpus 4 \\
      --max-minutes 27 --copy-to $OUT/ad
  (the same command again continues: runs resume from their checkpoints; a call from another source
  tree than the first call's is refused)
Project the whole plan from the steps measured so far: python -m experiments.aqn_dose.plan --out /tmp/ad
Summarize (CPU): python -m experiments.aqn_dose.run --summarize --out ad --results experiments/aqn_dose/results

Arms: configs/aqn_dose.py (sigma_start 0, 1e-2, 3e-2, 1e-1; 3 stages of 60 steps, noise from step 0).
A run that finishes is evaluated greedily on the whole GSM8K test (1319), per-problem outputs kept.
"""

from __future__ import annotations

import os
import sys

from experiments import launcher
from qerl_jax.config import data_path


def _summarize(out: str, results: str) -> dict:
    from experiments.aqn_dose.summarize import summarize  # noqa: PLC0415 (matplotlib only here)

    return summarize(out, results)


EXPERIMENT = launcher.Experiment(
    name="aqn_dose",
    module="experiments.aqn_dose.run",
    config_module="configs.aqn_dose",
    default_steps=180,
    default_results=os.path.join(launcher.REPO, "experiments", "aqn_dose", "results"),
    summarize=_summarize,
    final_eval_datasets=(data_path("gsm8k/test.jsonl"),),
    train_reserve_minutes=0.5,
    eval_minutes=2.0,  # GSM8K test alone: 1.2-1.9 min with MATH500 in the claims runs (H200, shared)
    max_mem_fraction=0.45,
    stages=("train",),  # the base models' numbers are the claims experiment's (same GGUF, same sha256)
    same_code=True,
)


if __name__ == "__main__":
    sys.exit(launcher.main(EXPERIMENT, __doc__.splitlines()[0]))
