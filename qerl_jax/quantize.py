"""The quantize-once command: a Hugging Face checkpoint (or GGUF file) to a compressed-tensors one.

  python -m qerl_jax.quantize --model=DIR --format=nvfp4 --out=DIR2     (or: qerl-quantize ...)

The work is `qerl_jax.quantize_checkpoint.quantize_checkpoint`; this module parses the flags (absl,
as `qerl_jax.main` and `qerl_jax.eval`: `--model DIR` and `--model=DIR` alike, `--nofuse_global_scale`;
the old `--no-fuse-global-scale` still works) and turns a bad flag or a QuantizeError into one line
on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from typing import Sequence

from absl import flags

from qerl_jax.quantize_checkpoint import QuantizeError, quantize_checkpoint

DESCRIPTION = "Quantize a Hugging Face safetensors checkpoint to a compressed-tensors (vLLM) checkpoint."
# Spellings of the argparse era, still accepted.
OLD_SPELLINGS = {"--no-fuse-global-scale": "--nofuse_global_scale", "--no_fuse_global_scale": "--nofuse_global_scale"}


def _flag_values() -> flags.FlagValues:
    """The command's flags (absl, spelt as main's and eval's: `--name=value`, `--noname` for a false boolean)."""
    fv = flags.FlagValues()
    flags.DEFINE_string(
        "model", None, "input checkpoint directory (config.json + *.safetensors) or a GGUF file", flag_values=fv
    )
    flags.DEFINE_string("out", None, "output directory (created; must be empty unless --overwrite)", flag_values=fv)
    flags.DEFINE_string("format", "nvfp4", "nvfp4 (default) or mxfp4", flag_values=fv)
    flags.DEFINE_boolean(
        "fuse_global_scale",
        True,
        "nvfp4: share one global scale across q/k/v and across gate/up (vLLM needs them shared); "
        "--nofuse_global_scale gives each projection its own",
        flag_values=fv,
    )
    flags.DEFINE_boolean("overwrite", False, "write into a non-empty --out directory", flag_values=fv)
    flags.DEFINE_boolean("quiet", False, "no progress bars", flag_values=fv)
    return fv


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command on `argv` (the arguments after the program name); returns the exit status."""
    argv = [OLD_SPELLINGS.get(a, a) for a in (sys.argv[1:] if argv is None else argv)]
    fv = _flag_values()
    if any(a in ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull") for a in argv):
        print(f"usage: qerl-quantize --model=DIR --out=DIR [--format=nvfp4|mxfp4] ...\n\n{DESCRIPTION}\n")
        print(fv.get_help())
        return 0
    try:
        rest = fv(["qerl-quantize", *argv])
    except flags.Error as e:
        return _fail(str(e))
    if len(rest) > 1:
        return _fail(f"unexpected arguments: {' '.join(rest[1:])}")
    missing = [f"--{name}" for name in ("model", "out") if fv[name].value is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        return _fail(f"{' and '.join(missing)} {verb} required, e.g. --model=DIR --out=DIR")
    try:
        out = quantize_checkpoint(
            fv.model,
            fv.out,
            fv.format,
            fuse_global_scale=fv.fuse_global_scale,
            overwrite=fv.overwrite,
            progress=not fv.quiet,
        )
    except QuantizeError as e:
        return _fail(str(e))
    print(f"wrote {fv.format} checkpoint to {out}")
    return 0


def _fail(message: str) -> int:
    print(f"qerl-quantize: error: {message}", file=sys.stderr)
    return 2


def run() -> None:
    """Console entry point `qerl-quantize`."""
    sys.exit(main())


if __name__ == "__main__":
    run()
