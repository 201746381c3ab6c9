"""Evaluate: `python -m qerl_jax.eval --config=configs/gsm8k.py --config.eval.checkpoint=runs/gsm8k`.

See `qerl_jax.evaluation` for what is measured and written.
"""

from __future__ import annotations

import json

from absl import logging

from qerl_jax import cli

_CONFIG = cli.define_config_flag()


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
    from qerl_jax import evaluation  # noqa: PLC0415 (after flag parsing: fast --help)

    summary = cli.run_command(evaluation.evaluate, _CONFIG, argv)
    print(json.dumps(summary["metrics"], indent=2))
    files = [f"{name}.jsonl" for name in summary["datasets"]] + ["summary.json", "tensorboard/"]
    print(f"outputs: {summary['output_dir']} ({', '.join(files)})")


def run() -> None:
    cli.run(main)


if __name__ == "__main__":
    run()
