#!/usr/bin/env bash
# On the GPU host, N GPUs (default 4): tiller bench train beside ../shared/bench/peer_bench.py fsdp
# (PyTorch FSDP2 on HF Qwen2, activation checkpointing) on the same shapes, in the same run, and
# the ratio of tokens/s/GPU. Copy peer_bench.py into .gpu/bench/ first (git-ignored; carry .gpu).
#   MODELS="qwen2-1.5b qwen2-7b" MBS=4 SEQ=2048 scripts/gpu/bench_train.sh [OUT.json]
# TRAIN_ARGS="--fp8" also times FP8 training's steps (roles.<r>.fp8) and reports them beside.
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
n=${NGPU:-4}
mbs=${MBS:-4}
seq=${SEQ:-2048}
peer=$tiller_root/.gpu/bench/peer_bench.py
[ -f "$peer" ] || { echo "bench_train.sh: $peer is missing; copy ../shared/bench/peer_bench.py there" >&2; exit 2; }
tmp=$(mktemp -d)
for model in ${MODELS:-qwen2-1.5b qwen2-7b}; do
  mpirun -np "$n" --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
    -x NVSHMEM_DISABLE_NVLS "$gpu_build/bin/tiller" bench train --model "$model" --seq "$seq" --micro-batch "$mbs" \
    ${TRAIN_ARGS:-} --out "$tmp/tiller-$model.json"
  torchrun --standalone --nproc-per-node "$n" "$peer" fsdp "${model#qwen2-}" "$seq" "$mbs" | grep '^{' | tail -1 \
    > "$tmp/peer-$model.json"
  cat "$tmp/peer-$model.json"
done
$python - "$tmp" "$out" ${MODELS:-qwen2-1.5b qwen2-7b} <<'PY'
import json, sys, datetime
tmp, out, models = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = []
for m in models:
    t = json.load(open(f"{tmp}/tiller-{m}.json"))
    p = json.loads(open(f"{tmp}/peer-{m}.json").read())
    row = {"model": m, "ratio_tokens_per_s": round(t["tokens_per_s_per_gpu"] / p["tokens_per_s_per_gpu"], 3)}
    if "fp8" in t:  # TRAIN_ARGS=--fp8: tiller's FP8 steps against bf16 (in t) and FSDP2
        row["fp8_speedup"] = round(t["fp8"]["speedup"], 3)
        row["fp8_ratio_tokens_per_s"] = round(t["fp8"]["tokens_per_s_per_gpu"] / p["tokens_per_s_per_gpu"], 3)
    row.update({"tiller": t, "fsdp2": p})
    rows.append(row)
res = {"bench": "train_vs_fsdp2", "date": datetime.date.today().isoformat(), "results": rows}
text = json.dumps(res)
print(text)
if out:
    open(out, "w").write(text + "\n")
PY
