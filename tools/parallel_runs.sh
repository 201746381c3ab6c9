#!/usr/bin/env bash
# Runs several commands at once on a GPU machine reached only by copying files (tools/README.md),
# one per GPU, each from its own source tree, and tars their logs and workdirs into $OUT/runs.tgz.
# For a change measured against a reference checkout on the same machine, side by side: lay the
# reference out in an ignored folder first, e.g.
#   git archive <commit> qerl_jax pallas_kernels configs experiments | tar -x -C .gpu/base
# and carry it. Each line of standard input is one run: GPU (CUDA_VISIBLE_DEVICES), tree, name,
# command (run in the tree; $WORK is /tmp/runs/<name>, its workdir):
#   printf '%s\n' '0 . new python3 -m qerl_jax.main --config=configs/gsm8k.py --config.workdir=$WORK' \
#                 '1 .gpu/base old python3 -m qerl_jax.main --config=configs/gsm8k.py --config.workdir=$WORK' \
#     | LIMIT=540 bash tools/parallel_runs.sh
# LIMIT: seconds each command may run (default 540). With .whl carried (the py3.12 wheels the
# machine lacks) they are installed first; QERL_DATA_DIR points at .gpu/data when it is carried.
set -u
OUT=${OUT:-/tmp/qerl_out}
LIMIT=${LIMIT:-540}
ROOT=$PWD
mkdir -p "$OUT" /tmp/runs
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
fi
[ -d .gpu/data ] && export QERL_DATA_DIR=$ROOT/.gpu/data
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
names=()
while read -r gpu tree name command; do
  [ -z "${gpu:-}" ] && continue
  mkdir -p "/tmp/runs/$name"
  (
    cd "$ROOT/$tree" || exit 2
    export CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=/tmp/site:$ROOT/$tree WORK=/tmp/runs/$name
    eval "timeout $LIMIT $command" > "/tmp/runs/$name.log" 2>&1
    echo "exit status $?" >> "/tmp/runs/$name.log"
  ) &
  names+=("$name")
done
wait
for name in "${names[@]}"; do echo "== $name: $(tail -n 1 /tmp/runs/$name.log)"; done
tar -czf "$OUT/runs.tgz" -C /tmp/runs --exclude='*/checkpoints' --exclude='*/adapter' --exclude='*.gguf' . 2>/dev/null
ls -la "$OUT"
