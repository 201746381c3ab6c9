"""The claims experiment on a real Qwen2.5: Qwen2.5-Coder-1.5B-Instruct, GSM8K (README.md here).

Train (one GPU; each (arm, seed) a process of the real loop, qerl_jax.train.train, side by side):
  python -m experiments.qwen_gsm8k.run --gguf /tmp/q15.gguf --out /tmp/qg --arms nvfp4 bf16 --seeds 0 1 \\
      --max-minutes 9 --copy-to $OUT/qg
  (the same command again continues: finished stages are skipped, runs resume from their checkpoints)
Summarize (CPU): python -m experiments.qwen_gsm8k.run --summarize --out qg --results experiments/qwen_gsm8k/results

Arms: configs/gsm8k_claims.py (every hyper-parameter, 150 steps); the stages: experiments/launcher.py.
A run that finishes is evaluated greedily on the whole GSM8K test (1319) and on MATH500.
"""

from __future__ import annotations

import os
import sys

from experiments import launcher
from qerl_jax.config import data_path


def _summarize(out: str, results: str) -> dict:
    from experiments.qwen_gsm8k.summarize import summarize  # noqa: PLC0415 (matplotlib only here)

    return summarize(out, results)


EXPERIMENT = launcher.Experiment(
    name="qwen_gsm8k",
    module="experiments.qwen_gsm8k.run",
    config_module="configs.gsm8k_claims",
    default_steps=150,
    default_results=os.path.join(launcher.REPO, "experiments", "qwen_gsm8k", "results"),
    summarize=_summarize,
    final_eval_datasets=(data_path("gsm8k/test.jsonl"), data_path("math500/test.jsonl")),
    train_reserve_minutes=0.5,  # the checkpoint and the adapter export; the evaluation runs after train.train
    eval_minutes=3.0,  # GSM8K test + MATH500 took 1.2-1.9 min in the runs (H200, beside other runs), plus loading
    max_mem_fraction=0.45,
)


if __name__ == "__main__":
    sys.exit(launcher.main(EXPERIMENT, __doc__.splitlines()[0]))
