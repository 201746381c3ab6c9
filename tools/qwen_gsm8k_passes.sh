#!/usr/bin/env bash
# Passes of the Qwen2.5-Coder-1.5B / GSM8K experiment (experiments/qwen_gsm8k/) on a GPU machine reached
# only by copying files (tools/README.md). Run from the repository root on that machine, with .whl
# (the py3.12 wheels it lacks) carried and the GGUF's pieces already moved to /tmp/parts (one
# piece per call: `mkdir -p /tmp/parts && mv .gpu/pieceNNN.bin /tmp/parts/`);
# `bash tools/gpu_inputs.sh` lays out .whl, .gpu/data and the pieces on the CPU machine.
#   bash tools/qwen_gsm8k_passes.sh base    # noise KL + greedy GSM8K test of bf16 and NVFP4, in parallel
#   bash tools/qwen_gsm8k_passes.sh step    # the recipe's first steps from qerl_jax.main, NVFP4 then bf16
#   bash tools/qwen_gsm8k_passes.sh eval    # greedy GSM8K test (1319 prompts, 1024 tokens) from qerl_jax.eval:
#                                           # bf16, NVFP4, bf16 again, one at a time, each with an empty compile cache
#   bash tools/qwen_gsm8k_passes.sh bench   # packed attention check, the 7B gsm8k GRPO step (padded vs packed); no model file needed
#   bash tools/qwen_gsm8k_passes.sh startup # the 1.5B's first steps (configs/gsm8k.py, NVFP4) from qerl_jax.main:
#                                           # cold, then warm from a copy of the checkout at another path
#                                           # (same compile and model caches)
#   QG_ARGS="--arms nvfp4 bf16 --seeds 0 1 --max-minutes 8" bash tools/qwen_gsm8k_passes.sh train
#   (EXP=aqn_dose runs experiments/aqn_dose instead, in this and the start / status / pack passes)
#                                           # the experiment's launcher (run.py); again on a warm machine resumes
# Runs longer than one call (while the machine stays between calls):
#   QG_ARGS="--arms bf16 nvfp4 nvfp4_aqn --seeds 0 1 --max-minutes 20 --mem-fraction 0.13" bash tools/qwen_gsm8k_passes.sh start
#   (more runs than fit: add --parallel 7; the others start as runs end)
#                                           # the launcher in the background; first unpacks /tmp/carry_parts
#                                           # (a carried experiment, tools/carry.py) into /tmp/qg if there is no /tmp/qg;
#                                           # under NVIDIA's MPS daemon (the processes' kernels overlap:
#                                           # 3 runs: 0.37 steps/s against 0.24-0.27 time-sliced); MPS=0 without it
#   SLEEP=500 bash tools/qwen_gsm8k_passes.sh status   # after SLEEP s: each run's steps and step times
#   BATCH=k bash tools/qwen_gsm8k_passes.sh pack       # once the launcher ended: batch k of the carry
#                                           # parts into $OUT (batch 0 also $OUT/light.tgz, the light copies)
#   On the next machine the parts go in as many a call as its send limit allows, the manifest with
#   the first: `mkdir -p /tmp/carry_parts && mv .gpu/carry/carry.* /tmp/carry_parts/`.
# Everything it writes is tarred into $OUT/<pass>.tgz ($OUT: the folder whose files the call brings back).
set -u
PASS=$1
EXP=${EXP:-qwen_gsm8k}  # the experiment whose launcher the train / start / status / pack passes run (EXP=aqn_dose)
OUT=${OUT:-/tmp/qerl_out}
W=/tmp/qw
mkdir -p "$OUT" $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 QERL_DATA_DIR=$PWD/.gpu/data
GGUF=/tmp/q15.gguf
case $PASS in
  bench|status|pack) ;;
  *) python3 -m experiments.models qwen2.5-coder-1.5b --parts /tmp/parts --out $GGUF || exit 2 ;;
esac
running() { ps aux | grep -c "[e]xperiments.$EXP.run"; }
case $PASS in
  start)
    if [ ! -d /tmp/qg ] && [ -d /tmp/carry_parts ]; then
      python3 -m tools.carry unpack --parts /tmp/carry_parts --dest /tmp/qg || exit 2
    fi
    [ "$(running)" = 0 ] || { echo "the launcher is already running"; exit 2; }
    rm -rf /tmp/qdata; cp -r .gpu/data /tmp/qdata  # the carried copy is replaced by the next call's tree
    if [ "${MPS:-1}" = 1 ]; then  # the runs' kernels overlap instead of time-slicing (3 runs: 0.37 vs 0.24-0.27 steps/s)
      if command -v nvidia-cuda-mps-control >/dev/null; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
        mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
        nvidia-cuda-mps-control -d && echo "MPS daemon started"
        # A client that cannot reach the daemon fails to start CUDA: check once, else go on without MPS.
        if ! timeout 120 python3 -c "import jax; jax.numpy.ones(8).block_until_ready(); print(jax.devices())"; then
          echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
          echo "MPS: a JAX client failed under the daemon; stopped it, the runs time-slice the GPU"
        fi
      else
        echo "no nvidia-cuda-mps-control on this machine: the runs time-slice the GPU"
      fi
    fi
    QERL_DATA_DIR=/tmp/qdata setsid nohup python3 -m experiments.$EXP.run --gguf $GGUF --out /tmp/qg \
      --copy-to $W/qg --stages train ${QG_ARGS:-} > $W/launcher.log 2>&1 < /dev/null &
    sleep 60; cat $W/launcher.log; nvidia-smi --query-gpu=memory.used --format=csv,noheader
    exit 0 ;;
  status)
    sleep ${SLEEP:-0}
    for f in /tmp/qg/runs/*/seed*/tensorboard/scalars.jsonl; do
      [ -f "$f" ] && python3 - "$f" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
later = rows[1:] or rows
median = lambda k: round(statistics.median(r[k] for r in later), 1) if later and k in later[0] else None
run = "/".join(sys.argv[1].split("/")[4:6])
print(f"{run}: {len(rows)} steps, first {rows[0].get('time/step_s', 0):.1f} s, then step {median('time/step_s')} s "
      f"(rollout {median('time/rollout_s')}, train {median('time/train_s')}), reward {rows[-1].get('reward/mean_sampled', 0):.3f}")
PY
    done
    tail -n 4 $W/launcher.log; echo "launcher processes: $(running)"
    [ -n "$(pgrep -f nvidia-cuda-mps-control)" ] && echo "MPS daemon running"
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    exit 0 ;;
  pack)
    [ "$(running)" = 0 ] || { echo "the launcher is still running: pack after it ends"; tail -n 4 $W/launcher.log; exit 3; }
    python3 -m tools.carry pack --src /tmp/qg --dest "$OUT" --batch ${BATCH:-0} || exit 2
    [ "${BATCH:-0}" = 0 ] && (cd $W && tar czf "$OUT/light.tgz" qg launcher.log)
    ls -la "$OUT"
    exit 0 ;;
esac
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s)
case $PASS in
  base)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
    timeout 500 python3 -m experiments.qwen_gsm8k.noise_kl --gguf $GGUF --out $W/noise_kl.json > $W/noise_kl.log 2>&1 &
    for q in bf16 nvfp4; do
      timeout 520 python3 -m qerl_jax.eval --config=configs/gsm8k.py --config.model.path=$GGUF --config.model.quant=$q \
        --config.workdir=$W/eval_$q --config.eval.batch_size=1319 --config.eval.max_new_tokens=1024 \
        > $W/eval_$q.log 2>&1 &
    done
    wait ;;
  eval)
    i=0
    for q in bf16 nvfp4 bf16; do
      i=$((i + 1)); t=$(date +%s)
      timeout 250 python3 -m qerl_jax.eval --config=configs/gsm8k.py --config.model.path=$GGUF --config.model.quant=$q \
        --config.workdir=$W/eval_${i}_$q --config.compile_cache_dir=$W/cc_$i --config.eval.batch_size=1319 \
        --config.eval.max_new_tokens=1024 > $W/eval_${i}_$q.log 2>&1
      echo "$q rc=$? wall $(( $(date +%s) - t )) s: $(head -c 600 $W/eval_${i}_$q/eval/summary.json | tr -d '\n ')"
    done ;;
  bench)
    timeout 60 python3 -m benchmarks.devtools.packed_attention_check > $W/packed_attention_check.log 2>&1
    echo "packed attention check rc=$?"; cat $W/packed_attention_check.log | tail -n 8
    timeout 330 python3 -m benchmarks.grpo_step --workload gsm8k --formats nvfp4,bf16 --timeout 160 \
      --out $W/grpo_gsm8k.json > $W/grpo_gsm8k.log 2>&1
    echo "grpo gsm8k rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 12 $W/grpo_gsm8k.log
    ;;
  startup)
    rm -rf /tmp/su && mkdir -p /tmp/su && cp -r "$PWD" /tmp/su/repo2
    for run in cold warm; do
      dir=$PWD; [ $run = warm ] && dir=/tmp/su/repo2
      (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 280 python3 -m qerl_jax.main --config=configs/gsm8k.py \
        --config.model.path=$GGUF --config.workdir=/tmp/su/w_$run --config.compile_cache_dir=/tmp/su/cc \
        --config.model.cache_dir=/tmp/su/mc --config.rollout.max_new_tokens=1024 --config.train.stop_after_steps=2 \
        --config.train.checkpoint_every=1000 2>&1 | while IFS= read -r line; do echo "$(date +%s) $line"; done > $W/startup_$run.log)
      echo "$run done after $(( $(date +%s) - T0 )) s"
      cp /tmp/su/w_$run/tensorboard/scalars.jsonl $W/startup_$run.scalars.jsonl 2>/dev/null
    done ;;
  step)
    for q in nvfp4 bf16; do
      timeout 270 python3 -m qerl_jax.main --config=configs/gsm8k.py --config.model.path=$GGUF --config.model.quant=$q \
        --config.workdir=$W/step_$q --config.rollout.max_new_tokens=1024 --config.train.stop_after_steps=4 \
        --config.train.checkpoint_every=1000 > $W/step_$q.log 2>&1
      echo "$q rc=$? after $(( $(date +%s) - T0 )) s"
    done ;;
  train)
    # /tmp/qg (checkpoints, compilation cache) stays on the machine for the next call; $W/qg is its light copy.
    python3 -m experiments.$EXP.run --gguf $GGUF --out /tmp/qg --copy-to $W/qg ${QG_ARGS:-}
    echo "launcher rc=$?" ;;
esac
echo "pass $PASS done after $(( $(date +%s) - T0 )) s"
for f in $W/*.log; do echo "== $f"; tail -n 15 $f | cut -c1-300; done
cd $W && tar czf "$OUT/$PASS.tgz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='jax_cache' --exclude='*.orbax*' . 2>/dev/null
ls -la "$OUT"
