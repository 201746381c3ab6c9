#!/usr/bin/env bash
# On a 4-GPU machine (after tools/gpu_inputs.sh --no-model; carry .whl and .gpu): multi-process runs of
# the tiny config, one process per GPU and two processes of two GPUs, 3 steps each. Prints each layout's
# exit codes and the gRPC error lines of its processes' logs (a run that succeeds should show none).
# TREE=DIR runs another checkout of the project (e.g. `git archive REV qerl_jax pallas_kernels configs`).
set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 QERL_DATA_DIR=$PWD/.gpu/data PYTHONUNBUFFERED=1
tree=${TREE:-.}
logs=${OUT:-/tmp}/clean_exit_logs
mkdir -p "$logs"
layout() {  # name processes gpus_per_process port
  local name=$1 n=$2 g=$3 port=$4 pids=() rcs="" i devs t0=$SECONDS
  rm -rf "/tmp/w_$name"
  for ((i = 0; i < n; i++)); do
    devs=$(seq -s, $((i * g)) $((i * g + g - 1)))
    (cd "$tree" && CUDA_VISIBLE_DEVICES=$devs QERL_NUM_PROCESSES=$n QERL_PROCESS_ID=$i \
      JAX_COORDINATOR_ADDRESS=127.0.0.1:$port timeout 240 python3 -m qerl_jax.main --config=configs/tiny.py \
      --config.workdir="/tmp/w_$name" --config.mesh.data=$((n * g)) --config.train.total_steps=3 \
      --config.eval.num_examples=0 > "$logs/${name}_p$i.log" 2>&1) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; rcs="$rcs $?"; done
  local grpc
  grpc=$(cat "$logs/${name}"_p*.log | grep -cE 'WatchTasks|UNAVAILABLE|failed to connect|Connection refused')
  echo "$name: $n processes x $g GPUs, exit codes$rcs, gRPC error lines $grpc, $((SECONDS - t0)) s"
}
layout one_per_gpu 4 1 12355
layout two_of_two 2 2 12356
