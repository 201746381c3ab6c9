#!/usr/bin/env bash
# One device call: rollout, end-to-end GRPO step and 32B scale benchmarks, each time-boxed,
# JSON + logs under $OUT. Run from the repo root with the .whl folder carried:
#   bash benchmarks/device_pass.sh
set -u
OUT=${OUT:-/tmp/qerl_bench}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
T0=$(date +%s)
timeout ${ROLLOUT_S:-270} python3 benchmarks/rollout.py --out "$OUT/rollout.json" --deadline $(( ${ROLLOUT_S:-270} - 30 )) > "$OUT/rollout.log" 2>&1
echo "rollout rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 25 "$OUT/rollout.log"
timeout ${GRPO_S:-200} python3 benchmarks/grpo_step.py --formats ${GRPO_FORMATS:-bf16,nvfp4} --timeout 95 --out "$OUT/grpo_step.json" > "$OUT/grpo_step.log" 2>&1
echo "grpo rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 6 "$OUT/grpo_step.log"
timeout ${SCALE_S:-100} python3 benchmarks/scale.py --models 32b --phases load,rollout,train --decode-steps 32 --out "$OUT/scale.json" > "$OUT/scale.log" 2>&1
echo "scale rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 20 "$OUT/scale.log"
