#!/usr/bin/env bash
# Delta weight sync against full pushes over gRPC to an engine on the same GPU, after real AdamW
# steps (tiller bench push; docs/sync.md, "Delta sync"). Usage: scripts/gpu/bench_push.sh OUT.jsonl
# [models, default qwen2-1.5b] ; LR (default 1e-6), ROUNDS (default 5), CHUNK_MB (default 8).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:?usage: bench_push.sh OUT.jsonl [models...]}
shift || true
models=("${@:-qwen2-1.5b}")
: > "$out"
for m in "${models[@]}"; do
  "$gpu_build/bin/tiller" bench push --model "$m" --rounds "${ROUNDS:-5}" --lr "${LR:-1e-6}" \
    --chunk-mb "${CHUNK_MB:-8}" | tail -1 | tee -a "$out"
done
