#!/usr/bin/env bash
# On the GPU host, after scripts/gpu/build.sh: the mixture of experts' kernels measured.
#   decode (GPU 0): qwen3-30b-a3b-8l at batch 64 and 256 with grouped experts (CUDA graphs), at
#     batch 64 eagerly and with the per-expert loop, and the dense model of its active parameters
#     (qwen3-a3b-dense-8l); the floor takes HBM GB/s (default 3350, an H100's).
#   training (2 GPUs): tiller bench train, grouped and loop, beside FSDP2 on transformers'
#     Qwen3-MoE (scripts/gpu/moe_peer.py; copy ../shared/bench/peer_bench.py into .gpu/bench/).
# One JSON line per run into OUT/decode.jsonl and OUT/train.jsonl.
#   HBM=3350 scripts/gpu/bench_moe.sh OUT
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=$1
mkdir -p "$out"
t=$gpu_build/bin/tiller
bw=${HBM:-3350}
gen() { CUDA_VISIBLE_DEVICES=0 "$t" bench generate --prompt-len 128 --hbm-gbps "$bw" "$@" | grep '^{' | tee -a "$out/decode.jsonl"; }
for b in 64 256; do
  gen --model qwen3-30b-a3b-8l --batch "$b" --new-tokens 128
  gen --model qwen3-a3b-dense-8l --batch "$b" --new-tokens 128
done
gen --model qwen3-30b-a3b-8l --batch 64 --new-tokens 128 --no-cuda-graphs
gen --model qwen3-30b-a3b-8l --batch 64 --new-tokens 32 --experts loop
mpi=(mpirun -np 2 --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
     -x NVSHMEM_DISABLE_NVLS)
"${mpi[@]}" "$t" bench train --model qwen3-30b-a3b-8l --seq 2048 --micro-batch 4 --steps 6 | grep '^{' | tee -a "$out/train.jsonl"
torchrun --standalone --nproc-per-node 2 "$tiller_root/scripts/gpu/moe_peer.py" 2048 4 | grep '^{' | tee -a "$out/train.jsonl"
"${mpi[@]}" "$t" bench train --model qwen3-30b-a3b-8l --seq 2048 --micro-batch 4 --steps 4 --experts loop |
  grep '^{' | tee -a "$out/train.jsonl"
