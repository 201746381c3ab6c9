"""Evaluate: `python -m qerl_jax.eval --config=configs/gsm8k.py --config.eval.checkpoint=runs/gsm8k`.

See `qerl_jax.evaluation` for what is measured and written.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.", lock_config=True)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from qerl_jax import evaluation, policy  # noqa: PLC0415 (after flag parsing: fast --help)

    logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO

    try:
        summary = evaluation.evaluate(_CONFIG.value)
    except policy.UserFacingError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(summary["metrics"], indent=2))


def run() -> None:
    flags.mark_flags_as_required(["config"])
    app.run(main)


if __name__ == "__main__":
    run()
