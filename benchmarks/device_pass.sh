#!/usr/bin/env bash
# One device call: the benchmarks named in STEPS (default: rollout grpo scale), each time-boxed,
# JSON + logs under $OUT. Run from the repo root with the .whl folder carried:
#   STEPS="rollout grpo" bash benchmarks/device_pass.sh
# Steps: rollout (benchmarks/rollout.py), grpo (grpo_step.py), scale (scale.py, 32B),
# kernels256 (kernels.py sweep + bench at M = 128 / 256), nulldecode (kernels.py diagnostic),
# dp (benchmarks/data_parallel.py: all local GPUs vs one).
set -u
OUT=${OUT:-/tmp/qerl_bench}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
T0=$(date +%s)
for step in ${STEPS:-rollout grpo scale}; do
  case $step in
    rollout)
      timeout ${ROLLOUT_S:-270} python3 benchmarks/rollout.py --out "$OUT/rollout.json" \
        --formats ${ROLLOUT_FORMATS:-bf16,nvfp4,mxfp4,nf4} --deadline $(( ${ROLLOUT_S:-270} - 40 )) > "$OUT/rollout.log" 2>&1
      echo "rollout rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 25 "$OUT/rollout.log" ;;
    grpo)
      timeout ${GRPO_S:-200} python3 benchmarks/grpo_step.py --formats ${GRPO_FORMATS:-bf16,nvfp4} \
        --timeout ${GRPO_CASE_S:-95} --out "$OUT/grpo_step.json" > "$OUT/grpo_step.log" 2>&1
      echo "grpo rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 8 "$OUT/grpo_step.log" ;;
    scale)
      timeout ${SCALE_S:-100} python3 benchmarks/scale.py --models ${SCALE_MODELS:-32b} --phases load,rollout,train \
        --decode-steps 32 --out "$OUT/scale.json" > "$OUT/scale.log" 2>&1
      echo "scale rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 20 "$OUT/scale.log" ;;
    persistent)  # decode sweep with the persistent-loop candidates, then the decode bench
      timeout ${PERS_S:-380} python3 benchmarks/kernels.py --out "$OUT/kernels_persistent.json" --sections env,sweep,bench \
        --deadline $(( ${PERS_S:-380} - 25 )) --sweep-deadline $(( ${PERS_S:-380} - 150 )) --ms 1,16,64 --bwd-ms "" \
        --sweep-decode-ms 16,64 --sweep-prefill-ms "" --sweep-decode-cands 11,13,14,15,6 > "$OUT/kernels_persistent.log" 2>&1
      echo "persistent rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 30 "$OUT/kernels_persistent.log" ;;
    kernels256)
      timeout ${KERNELS_S:-200} python3 benchmarks/kernels.py --out "$OUT/kernels256.json" --sections env,sweep,bench \
        --deadline $(( ${KERNELS_S:-200} - 20 )) --ms 128,256 --bwd-ms "" --sweep-decode-ms "" \
        --sweep-prefill-ms 256 --sweep-prefill-cands 1,2,5,6,7,8 --models ${KERNELS_MODELS:-7B} > "$OUT/kernels256.log" 2>&1
      echo "kernels256 rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 22 "$OUT/kernels256.log" ;;
    nulldecode)  # diagnostic: the same kernels with the nibble decode replaced by a byte->bf16 convert
      timeout ${NULL_S:-120} python3 benchmarks/kernels.py --out "$OUT/kernels_null.json" --sections bench --null-decode \
        --deadline $(( ${NULL_S:-120} - 15 )) --ms 16,64 --models 7B > "$OUT/kernels_null.log" 2>&1
      echo "nulldecode rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 12 "$OUT/kernels_null.log" ;;
    dp)  # all local GPUs vs one (e.g. on nvidia-h200-x2)
      timeout ${DP_S:-300} python3 benchmarks/data_parallel.py --model ${DP_MODEL:-7B} --out "$OUT/data_parallel.json" \
        > "$OUT/data_parallel.log" 2>&1
      echo "dp rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 10 "$OUT/data_parallel.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
