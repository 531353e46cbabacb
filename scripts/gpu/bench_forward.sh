#!/usr/bin/env bash
# On the GPU host: `tiller bench forward` for the Qwen2 0.5B/1.5B/7B shapes at seq 2048 on one
# GPU (bf16, flash attention), with the bf16 matmul rate measured in the same run.
# Usage: scripts/gpu/bench_forward.sh OUT.json [extra tiller bench forward options]
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:?usage: bench_forward.sh OUT.json [options]}
shift
[ -x "$gpu_build/bin/tiller" ] || bash "$tiller_root/scripts/gpu/build.sh"
"$gpu_build/bin/tiller" bench forward --model qwen2-0.5b,qwen2-1.5b,qwen2-7b --seq 2048 --micro-batch 4 \
  --dtype bf16 --warmup 2 --iters 5 --out "$out" "$@"
