#!/usr/bin/env bash
# On the GPU host: tiller bench train in several memory settings beside one FSDP2 run of the same
# job (../shared/bench/peer_bench.py fsdp, activation checkpointing; copy it into .gpu/bench/), in
# one call, so peaks and rates compare on one machine. Each tiller line carries its own peak, the
# memory plan's estimate of it and the ratio to FSDP2's tokens/s and peak.
#   MODEL=qwen2-7b NGPU=2 MBS=4 SEQ=2048 \
#   VARIANTS="--recompute blocks --compute-shard cast;--recompute auto;--optimizer-offload cpu" \
#   scripts/gpu/bench_memory.sh [OUT.jsonl]
# ONE_GPU="--optimizer-offload cpu" adds a run on one GPU (np 1) with those flags (no peer).
# ACCUM=N times N micro-batches per optimizer step on both sides (tiller's --accumulate; the peer
# is then scripts/gpu/fsdp_accumulate_peer.py), STEPS=S steps each (the first two untimed).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-/dev/null}
n=${NGPU:-2}
model=${MODEL:-qwen2-7b}
mbs=${MBS:-4}
seq=${SEQ:-2048}
accum=${ACCUM:-1}
steps=${STEPS:-6}
[ "$steps" -ge 3 ] || { echo "bench_memory.sh: STEPS=$steps: at least 3 (two warm-up steps are not timed)" >&2; exit 2; }
peer=$tiller_root/.gpu/bench/peer_bench.py
[ -f "$peer" ] || { echo "bench_memory.sh: $peer is missing; copy ../shared/bench/peer_bench.py there" >&2; exit 2; }
tmp=${LOGDIR:-$(mktemp -d)}  # each run's JSON and log (LOGDIR keeps them)
mkdir -p "$tmp"
mpi=(mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
     -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH)
if [ -z "${SKIP_PEER:-}" ]; then
  if [ "$accum" -eq 1 ] && [ "$steps" -eq 6 ]; then
    peer_cmd=("$peer" fsdp "${model#qwen2-}" "$seq" "$mbs")
  else
    peer_cmd=("$tiller_root/scripts/gpu/fsdp_accumulate_peer.py" "${model#qwen2-}" "$seq" "$mbs" "$accum" "$steps")
  fi
  torchrun --standalone --nproc-per-node "$n" "${peer_cmd[@]}" | grep '^{' | tail -1 \
    > "$tmp/peer.json" || echo '{}' > "$tmp/peer.json"
  cat "$tmp/peer.json"
else
  echo '{}' > "$tmp/peer.json"
fi
i=0
IFS=';' read -r -a variants <<< "${VARIANTS:---recompute blocks --compute-shard cast;--recompute auto}"
run() {  # NP FLAGS...
  local np=$1; shift
  # shellcheck disable=SC2068
  if "${mpi[@]}" -np "$np" "$gpu_build/bin/tiller" bench train --model "$model" --seq "$seq" --micro-batch "$mbs" \
       --accumulate "$accum" --steps "$steps" $@ --out "$tmp/t$i.json" > "$tmp/t$i.log" 2>&1; then
    :
  else
    # A refusal of the memory plan or a failure: keep its last lines as the row.
    $python -c 'import json,sys; print(json.dumps({"error": open(sys.argv[1]).read()[-600:]}))' "$tmp/t$i.log" > "$tmp/t$i.json"
  fi
  $python - "$tmp/peer.json" "$tmp/t$i.json" "$np" "$*" <<'PY' | tee -a "$out"
import json, sys
peer = json.load(open(sys.argv[1]))
t = json.load(open(sys.argv[2]))
row = {"np": int(sys.argv[3]), "flags": sys.argv[4], "tiller": t}
if "tokens_per_s_per_gpu" in t and peer.get("tokens_per_s_per_gpu"):
    row["ratio_tokens_per_s"] = round(t["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"], 3)
    row["peak_minus_fsdp2_GiB"] = round(t["peak_mem_GiB"] - peer["peak_mem_GiB"], 2)
row["fsdp2"] = peer
print(json.dumps(row))
PY
  i=$((i + 1))
}
for v in "${variants[@]}"; do
  # shellcheck disable=SC2086
  run "$n" $v
done
if [ -n "${ONE_GPU:-}" ]; then
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 run 1 $ONE_GPU
fi
