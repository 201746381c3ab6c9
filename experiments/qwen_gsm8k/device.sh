#!/usr/bin/env bash
# Device passes of the Qwen2.5-Coder-1.5B / GSM8K experiment, run from the repo root on the GPU
# machine with .whl (the py3.12 wheels the machine lacks) carried and the GGUF's raw parts already
# moved to /tmp/parts (one 50 MiB part per call: `mkdir -p /tmp/parts && mv .gpu/partNN.bin /tmp/parts/`).
#   bash experiments/qwen_gsm8k/device.sh base    # noise KL + greedy GSM8K test of bf16 and NVFP4, in parallel
#   bash experiments/qwen_gsm8k/device.sh step    # the recipe's first steps from qerl_jax.main, NVFP4 then bf16
#   bash experiments/qwen_gsm8k/device.sh bench   # packed attention check, the 7B gsm8k GRPO step (padded vs packed); no model file needed
#   QG_ARGS="--arms nvfp4 bf16 --seeds 0 1 --max-minutes 8" bash experiments/qwen_gsm8k/device.sh train
#                                                 # the experiment's launcher (run.py); again on a warm machine resumes
# Everything it writes is tarred into $OUT/<pass>.tgz.
set -u
PASS=$1
OUT=${OUT:-/tmp/qerl_out}
W=/tmp/qw
mkdir -p "$OUT" $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 QERL_DATA_DIR=$PWD/.gpu/data
GGUF=/tmp/q15.gguf
[ $PASS = bench ] || python3 -m experiments.models qwen2.5-coder-1.5b --parts /tmp/parts --out $GGUF || exit 2
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
  bench)
    timeout 60 python3 -m benchmarks.devtools.packed_attention_check > $W/packed_attention_check.log 2>&1
    echo "packed attention check rc=$?"; cat $W/packed_attention_check.log | tail -n 8
    timeout 330 python3 -m benchmarks.grpo_step --workload gsm8k --formats nvfp4,bf16 --timeout 160 \
      --out $W/grpo_gsm8k.json > $W/grpo_gsm8k.log 2>&1
    echo "grpo gsm8k rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 12 $W/grpo_gsm8k.log
    ;;
  step)
    for q in nvfp4 bf16; do
      timeout 270 python3 -m qerl_jax.main --config=configs/gsm8k.py --config.model.path=$GGUF --config.model.quant=$q \
        --config.workdir=$W/step_$q --config.rollout.max_new_tokens=1024 --config.train.stop_after_steps=4 \
        --config.train.checkpoint_every=1000 > $W/step_$q.log 2>&1
      echo "$q rc=$? after $(( $(date +%s) - T0 )) s"
    done ;;
  train)
    # /tmp/qg (checkpoints, compilation cache) stays on the machine for the next call; $W/qg is its light copy.
    python3 -m experiments.qwen_gsm8k.run --gguf $GGUF --out /tmp/qg --copy-to $W/qg ${QG_ARGS:-}
    echo "launcher rc=$?" ;;
esac
echo "pass $PASS done after $(( $(date +%s) - T0 )) s"
for f in $W/*.log; do echo "== $f"; tail -n 15 $f | cut -c1-300; done
cd $W && tar czf "$OUT/$PASS.tgz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='jax_cache' --exclude='*.orbax*' . 2>/dev/null
ls -la "$OUT"
