#!/usr/bin/env bash
# The benchmarks on a GPU machine reached only by copying files (tools/README.md): one call runs the
# benchmarks named in STEPS (default: rollout grpo scale), each time-boxed, JSON + logs under $OUT
# (the folder whose files the call brings back). Run from the repository root with the .whl folder
# (tools/gpu_inputs.sh) carried:
#   STEPS="rollout grpo" bash tools/benchmark_passes.sh
# Steps: rollout (benchmarks/rollout.py), grpo (grpo_step.py), scale (scale.py, 32B),
# kernels256 (kernels.py sweep + bench at M = 128 / 256), nulldecode (kernels.py diagnostic),
# stages (decode sweep of the unpipelined / 2-stage candidates), block (check + sweep of the nvfp4
# block kernel against the table's entry + bench; BLOCK_MS, BLOCK_CANDS, BLOCK_BENCH_MS, BLOCK_MODELS),
# dp (benchmarks/data_parallel.py: all local GPUs vs one),
# cmdbuf (the 1.5B decode step without and with the decode loops in command buffers).
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
      timeout ${ROLLOUT_S:-270} python3 -m benchmarks.rollout --out "$OUT/rollout.json" \
        --formats ${ROLLOUT_FORMATS:-bf16,nvfp4,mxfp4,nf4} --deadline $(( ${ROLLOUT_S:-270} - 40 )) > "$OUT/rollout.log" 2>&1
      echo "rollout rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 25 "$OUT/rollout.log" ;;
    grpo)
      timeout ${GRPO_S:-200} python3 -m benchmarks.grpo_step --formats ${GRPO_FORMATS:-bf16,nvfp4} \
        --timeout ${GRPO_CASE_S:-95} --out "$OUT/grpo_step.json" > "$OUT/grpo_step.log" 2>&1
      echo "grpo rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 8 "$OUT/grpo_step.log" ;;
    scale)
      timeout ${SCALE_S:-100} python3 -m benchmarks.scale --models ${SCALE_MODELS:-32b} --phases load,rollout,train \
        --decode-steps 32 --out "$OUT/scale.json" > "$OUT/scale.log" 2>&1
      echo "scale rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 20 "$OUT/scale.log" ;;
    kernels256)
      timeout ${KERNELS_S:-200} python3 -m benchmarks.kernels --out "$OUT/kernels256.json" --sections env,sweep,bench \
        --deadline $(( ${KERNELS_S:-200} - 20 )) --ms 128,256 --bwd-ms "" --sweep-decode-ms "" \
        --sweep-prefill-ms 256 --sweep-prefill-cands 1,2,5,6,7,8 --models ${KERNELS_MODELS:-7B} > "$OUT/kernels256.log" 2>&1
      echo "kernels256 rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 22 "$OUT/kernels256.log" ;;
    nulldecode)  # diagnostic: the same kernels with the nibble decode replaced by a byte->bf16 convert
      timeout ${NULL_S:-120} python3 -m benchmarks.kernels --out "$OUT/kernels_null.json" --sections bench --null-decode \
        --deadline $(( ${NULL_S:-120} - 15 )) --ms 16,64 --models 7B > "$OUT/kernels_null.log" 2>&1
      echo "nulldecode rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 12 "$OUT/kernels_null.log" ;;
    stages)  # decode sweep: unpipelined / 2-stage candidates against the table's best (11)
      timeout ${STAGES_S:-200} python3 -m benchmarks.kernels --out "$OUT/kernels_stages.json" --sections env,sweep \
        --deadline $(( ${STAGES_S:-200} - 15 )) --models 7B --sweep-decode-ms ${STAGES_MS:-16} --sweep-prefill-ms "" \
        --sweep-decode-cands 11,13,14,15,16,17,18,19 > "$OUT/kernels_stages.log" 2>&1
      echo "stages rc=$? after $(( $(date +%s) - T0 )) s"; python3 -c "import json; d = json.load(open('$OUT/kernels_stages.json')); [print(r['m'], r['n'], r['k'], [r['cfg'][c] for c in ('bn', 'bk', 'split_k', 'num_warps', 'num_stages')], r.get('us'), r.get('rel_err')) for r in d['sweep']]" ;;
    block)  # correctness + sweep of the nvfp4 block kernel (with the table's previous best, 11, as control) + bench
      timeout ${BLOCK_S:-560} python3 -m benchmarks.kernels --out "$OUT/kernels_block.json" --sections env,check,sweep,bench \
        --check-quick --deadline $(( ${BLOCK_S:-560} - 20 )) --sweep-deadline $(( ${BLOCK_S:-560} - 200 )) \
        --sweep-decode-ms ${BLOCK_MS:-16} --sweep-prefill-ms "" --sweep-decode-cands ${BLOCK_CANDS:-11,20,21,22,23,25} \
        --ms ${BLOCK_BENCH_MS:-1,16} --models ${BLOCK_MODELS:-7B,32B} --bwd-ms "" > "$OUT/kernels_block.log" 2>&1
      echo "block rc=$? after $(( $(date +%s) - T0 )) s"; grep -E "^CHECK|ERROR" "$OUT/kernels_block.log" | cut -c1-200 | tail -n 12
      python3 -c "import json; d = json.load(open('$OUT/kernels_block.json')); [print(r['m'], r['n'], r['k'], [r['cfg'][c] for c in ('mode', 'bn', 'bk', 'split_k', 'num_warps', 'num_stages')], r.get('us'), r.get('rel_err')) for r in d['sweep']]; [print('BENCH', r['m'], r['n'], r['k'], r.get('cfg', {}).get('mode'), round(r.get('ours_us', 0), 1), round(r.get('bf16_us', 0), 1), round(r.get('speedup_vs_bf16', 0), 3)) for r in d['bench']]" ;;
    dp)  # all local GPUs vs one (on a host with several)
      timeout ${DP_S:-300} python3 -m benchmarks.data_parallel --model ${DP_MODEL:-7B} --out "$OUT/data_parallel.json" \
        > "$OUT/data_parallel.log" 2>&1
      echo "dp rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 10 "$OUT/data_parallel.log" ;;
    cmdbuf)  # the 1.5B decode step with XLA's default command buffers (the step's kernels: one graph),
             # then with the decode while loop captured too (+WHILE,+CONDITIONAL: no host round trip per
             # step). Wall clock: a profiler trace would switch command buffers off
      for variant in default while; do
        flags=""; [ $variant = while ] && flags="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
        XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout ${CMDBUF_S:-270} python3 -m benchmarks.rollout --model 1.5B \
          --formats bf16,nvfp4 --batches ${CMDBUF_BATCHES:-1x1,2x8,16x8} --no-peer --deadline $(( ${CMDBUF_S:-270} - 30 )) \
          --out "$OUT/rollout_cmdbuf_$variant.json" > "$OUT/rollout_cmdbuf_$variant.log" 2>&1
        echo "cmdbuf $variant rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 12 "$OUT/rollout_cmdbuf_$variant.log" | cut -c1-230
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
