"""Train: `python -m qerl_jax.main --config=configs/gsm8k.py [--config.rollout.group_size=16 ...]`."""

from __future__ import annotations

from absl import logging

from qerl_jax import cli

_CONFIG = cli.define_config_flag()


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    from qerl_jax import distributed, train  # noqa: PLC0415 (after flag parsing: fast --help)

    cli.run_command(train.train, _CONFIG, argv, resumable=True)
    distributed.leave()  # several processes: each ends here, in order (its docstring)


def run() -> None:
    cli.run(main)


if __name__ == "__main__":
    run()
