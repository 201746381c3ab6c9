"""The fidelity experiment: do the paper's claims hold on a real pretrained model? (README.md here)

Train (one GPU; each (arm, seed) a process of the real loop, qerl_jax.train.train, side by side):
  python -m experiments.fidelity.run --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/fidelity --max-minutes 9
  (run it again with the same --out to continue: finished stages are skipped, runs resume from their checkpoints)
Summarize (CPU is fine): the PNG, the markdown table and the claims' answers:
  python -m experiments.fidelity.run --summarize --out runs/fidelity --results experiments/fidelity/results
CPU smoke test of both: add --tiny (3 steps, a few short rollouts).

Arms: configs/arithmetic_smollm2.py; the stages and the launcher: experiments/launcher.py.
"""

from __future__ import annotations

import os
import sys

from experiments import launcher


def _summarize(out: str, results: str) -> dict:
    from experiments.fidelity.summarize import summarize  # noqa: PLC0415 (matplotlib only here)

    return summarize(out, results)


def _smollm2_gguf() -> str:
    from experiments.models import smollm2_gguf_path  # noqa: PLC0415

    return smollm2_gguf_path()


EXPERIMENT = launcher.Experiment(
    name="fidelity",
    module="experiments.fidelity.run",
    config_module="configs.arithmetic_smollm2",
    default_steps=200,
    default_results=os.path.join(launcher.REPO, "experiments", "fidelity", "results"),
    summarize=_summarize,
    train_reserve_minutes=1.5,  # train.train's own final evaluation (256 problems) and the adapter export
    max_mem_fraction=0.3,
    default_gguf=_smollm2_gguf,
)


if __name__ == "__main__":
    sys.exit(launcher.main(EXPERIMENT, __doc__.splitlines()[0]))
