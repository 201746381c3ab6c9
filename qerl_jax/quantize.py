"""The quantize-once command: a Hugging Face checkpoint (or GGUF file) to a compressed-tensors one.

  python -m qerl_jax.quantize --model DIR --format nvfp4 --out DIR2     (or: qerl-quantize ...)

The work is `qerl_jax.quantize_checkpoint.quantize_checkpoint`; this module parses the flags
and turns a QuantizeError into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from qerl_jax.quantize_checkpoint import QuantizeError, quantize_checkpoint


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qerl-quantize",
        description="Quantize a Hugging Face safetensors checkpoint to a compressed-tensors (vLLM) checkpoint.",
    )
    parser.add_argument(
        "--model", required=True, help="input checkpoint directory (config.json + *.safetensors) or a GGUF file"
    )
    parser.add_argument("--out", required=True, help="output directory (created; must be empty unless --overwrite)")
    parser.add_argument("--format", default="nvfp4", help="nvfp4 (default) or mxfp4")
    parser.add_argument(
        "--no-fuse-global-scale",
        action="store_true",
        help="nvfp4: give each projection its own global scale instead of sharing one across q/k/v and gate/up "
        "(vLLM needs them shared)",
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        out = quantize_checkpoint(
            args.model,
            args.out,
            args.format,
            fuse_global_scale=not args.no_fuse_global_scale,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except QuantizeError as e:
        print(f"qerl-quantize: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.format} checkpoint to {out}")
    return 0


def run() -> None:
    """Console entry point `qerl-quantize`."""
    sys.exit(main())


if __name__ == "__main__":
    run()
