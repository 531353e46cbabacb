#!/usr/bin/env bash
# The hybrid TP stall of 2026-11-27, reproduced: CONFIG (default the 32B LoRA GRPO example, as a
# hybrid job at TP 2 on 2 GPUs, sleep level 2, 8 prompts x 8 samples of 256 tokens) with its
# trainers scoring while the engine generates (cluster.hybrid_scoring=overlap, which tiller train
# refuses for TP > 1 over NCCL unless TILLER_ALLOW_HYBRID_TP_OVERLAP=1). If no step completes within
# WAIT seconds of the weight sync plan, every rank's stacks go to OUT/stacks.txt (stacks.sh) and the
# job is ended; then the same job runs with cluster.hybrid_scoring=auto (after_generate) for STEPS
# steps through train_examples.sh. After scripts/gpu/build.sh and scripts/gpu/make_models.sh 32b.
# On cards larger than 80 GB, GPU_MEMORY_GB=79 plans for an H100 and caps the allocators at that
# (cluster.gpu_memory_gb): the stall of 2026-11-27 came with the H100's memory near full.
#   [GPU_MEMORY_GB=79] scripts/gpu/hybrid_stall.sh OUT [WAIT] [STEPS]
set -uo pipefail
source "$(dirname "$0")/env.sh"
out=$1; wait_s=${2:-90}; steps=${3:-3}
mkdir -p "$out/overlap"
cd "$tiller_root"
name=qwen2.5-32b-lora-grpo-2gpu
layout=(--set cluster.hybrid=true --set roles.actor.gpus=2 --set engines.tp=2 --set engines.sleep_level=2
        --set rollout.batch_size=8 --set train.train_batch_size=64 --set rollout.max_new_tokens=256
        --set logging.efficiency=false --set timeouts.collective_s=300 --set checkpoint.dir=)
[ -n "${GPU_MEMORY_GB:-}" ] && layout+=(--set cluster.gpu_memory_gb="$GPU_MEMORY_GB")
bash scripts/gpu/make_models.sh 32b
CUDA_VISIBLE_DEVICES=0,1 TILLER_ALLOW_HYBRID_TP_OVERLAP=1 \
  mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
  -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH -x CUDA_VISIBLE_DEVICES -x TILLER_ALLOW_HYBRID_TP_OVERLAP -np 3 \
  "$gpu_build/bin/tiller" train -c "configs/gpu/$name.yaml" "${layout[@]}" --set cluster.hybrid_scoring=overlap \
  --set train.num_steps="$steps" --set run.output_dir="$out/overlap" > "$out/overlap/log.txt" 2>&1 &
job=$!
t0=$(date +%s); planned=0
while kill -0 $job 2>/dev/null; do
  sleep 2
  if [ $planned -eq 0 ] && grep -q "weight sync plan" "$out/overlap/log.txt"; then planned=$(date +%s); fi
  grep -q "step 1/" "$out/overlap/log.txt" && { echo "overlap: step 1 completed ($(( $(date +%s) - t0 )) s)"; break; }
  if [ $planned -gt 0 ] && [ $(( $(date +%s) - planned )) -ge "$wait_s" ]; then
    echo "overlap: no step $wait_s s after the sync plan; stacks to $out/stacks.txt"
    bash scripts/gpu/stacks.sh > "$out/stacks.txt" 2>&1
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv >> "$out/stacks.txt"
    break
  fi
done
kill $job 2>/dev/null; pkill -x tiller; sleep 3; pkill -9 -x tiller; wait $job 2>/dev/null
grep -E "step [0-9]+/|error|watchdog" "$out/overlap/log.txt" | cut -c1-300 | tail -8
sets=""
for kv in cluster.hybrid=true roles.actor.gpus=2 engines.tp=2 engines.sleep_level=2 \
          ${GPU_MEMORY_GB:+cluster.gpu_memory_gb=$GPU_MEMORY_GB}; do sets+="$kv,"; done
SET="--set rollout.batch_size=8 --set train.train_batch_size=64 --set rollout.max_new_tokens=256 --set logging.efficiency=false --set timeouts.collective_s=300" \
  bash scripts/gpu/train_examples.sh "$out" "$steps" "$name:${sets%,}"
