#!/usr/bin/env bash
# On the GPU host: long-sequence training with sequence parallelism (issue 24). tiller bench train
# with one sequence group of SP ranks at sequence lengths LENS, against the same number of tokens
# per GPU in 4k-token samples without sequence parallelism (the baseline), in the same run; reports
# tokens/s/GPU, their ratio to the baseline and peak memory per rank. A length that does not fit
# is recorded with its error instead of ending the script.
#   MODEL=qwen2-7b NGPU=4 SP=4 TOKENS=32768 LENS="8192 32768 65536 131072" scripts/gpu/bench_long.sh [OUT.json]
# CP=R: of the SP ranks, R groups all-gather keys instead of splitting heads (context parallelism).
# GPU_MEMORY_GB=G plans for (and caps each rank's allocator at) a G GiB GPU; PYTORCH_CUDA_ALLOC_CONF,
# when set, reaches the ranks (expandable_segments:True against PyTorch's default).
# RUN_TIMEOUT (s, default 300) ends a run that takes longer; STACKS_DIR=dir keeps its ranks' stacks.
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
n=${NGPU:-4}
sp=${SP:-$n}
cp=${CP:-1}
model=${MODEL:-qwen2-7b}
per_gpu=${TOKENS:-32768}
steps=${STEPS:-4}
tmp=$(mktemp -d)
extra=()
[ -n "${GPU_MEMORY_GB:-}" ] && extra+=(--gpu-memory-gb "$GPU_MEMORY_GB")
mpi_env=()
[ -n "${PYTORCH_CUDA_ALLOC_CONF:-}" ] && mpi_env+=(-x PYTORCH_CUDA_ALLOC_CONF)
bench() {  # name seq micro-batch sp cp
  # A run past RUN_TIMEOUT (s) is ended; its ranks' stacks (stacks.sh) go to STACKS_DIR first, if set.
  mpirun -np "$n" --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE \
      -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS "${mpi_env[@]}" "$gpu_build/bin/tiller" bench train --model "$model" \
      --seq "$2" --micro-batch "$3" --sequence-parallel "$4" --context-parallel "$5" --steps "$steps" "${extra[@]}" \
      --out "$tmp/$1.json" > "$tmp/$1.log" 2>&1 &
  local job=$! waited=0 code=0
  while kill -0 "$job" 2>/dev/null && [ "$waited" -lt "${RUN_TIMEOUT:-300}" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$job" 2>/dev/null; then
    echo "ran past ${RUN_TIMEOUT:-300} s: ended" >> "$tmp/$1.log"
    [ -n "${STACKS_DIR:-}" ] && mkdir -p "$STACKS_DIR" && bash "$(dirname "$0")/stacks.sh" > "$STACKS_DIR/$1.txt" 2>&1
    kill "$job"; sleep 2; pkill -9 -x tiller || true
  fi
  wait "$job" || code=$?
  if [ "$code" -ne 0 ] || [ ! -s "$tmp/$1.json" ]; then
    $python -c 'import json,sys; print(json.dumps({"seq": int(sys.argv[1]), "sequence_parallel": int(sys.argv[2]),
      "error": open(sys.argv[3]).read()[-600:]}))' "$2" "$4" "$tmp/$1.log" > "$tmp/$1.json"
  fi
  cat "$tmp/$1.json"
}
bench base 4096 $(( per_gpu / 4096 )) 1 1
lens=${LENS:-8192 32768 65536 131072}
for len in $lens; do
  mbs=$(( per_gpu * sp / len )); [ "$mbs" -ge 1 ] || mbs=1
  bench "sp-$len" "$len" "$mbs" "$sp" "$cp"
done
$python - "$tmp" "$out" "$model" "$n" $lens <<'PY'
import json, sys, datetime
tmp, out, model, n, lens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
base = json.load(open(f"{tmp}/base.json"))
rows = []
for L in lens:
    r = json.load(open(f"{tmp}/sp-{L}.json"))
    if "tokens_per_s_per_gpu" in r and "tokens_per_s_per_gpu" in base:
        r["ratio_to_4k_baseline"] = round(r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
    rows.append(r)
res = {"bench": "train_long_sequences", "date": datetime.date.today().isoformat(), "model": model, "gpus": n,
       "baseline_4k": base, "results": rows}
text = json.dumps(res)
print(text)
if out:
    open(out, "w").write(text + "\n")
PY
