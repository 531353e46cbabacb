#!/usr/bin/env bash
# On the GPU host (4 GPUs), after scripts/gpu/build.sh:
#  1. the quickstart's toy task on GPUs (actor, critic and engine on one GPU each, bf16, NCCL):
#     the reward must rise there too;
#  2. PPO on a Qwen2-1.5B-shaped model (configs/gpu/qwen2.5-1.5b-ppo-4gpu.yaml) for a few steps,
#     with random weights of that shape (scripts/gpu/make_models.sh) and a reward model with a value head.
# Writes metrics (JSONL) and a Chrome trace of step 3 under OUT (default out/gpu).
#   scripts/gpu/train_ppo.sh [OUT]
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-$tiller_root/out/gpu}
mkdir -p "$out"
cd "$tiller_root"
tiller=$gpu_build/bin/tiller
mpi=(mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
     -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH)
$python scripts/make_quickstart.py
if [ "${SKIP_TOY:-0}" != 1 ]; then
  "${mpi[@]}" -np 4 "$tiller" train -c configs/quickstart.yaml --set cluster.device=cuda --set cluster.backend=nccl \
    --set roles.actor.dtype=bf16 --set roles.critic.dtype=bf16 --set roles.ref.dtype=bf16 \
    --set run.output_dir="$out/toy" --set checkpoint.dir="$out/toy/checkpoints" 2>&1 | tee "$out/toy.log" \
    | grep -E "step [0-9]+/|event|error" || echo "train_ppo.sh: the toy run failed (see $out/toy.log)"
fi
bash scripts/gpu/make_models.sh 1.5b 1.5b-rm
"${mpi[@]}" -np 5 "$tiller" train -c configs/gpu/qwen2.5-1.5b-ppo-4gpu.yaml --set run.output_dir="$out/ppo-1.5b" \
  --profile 3 ${PPO_SET:-} 2>&1 | tee "$out/ppo-1.5b.log" | grep -E "step [0-9]+/|event|error|rank plan" -A0
