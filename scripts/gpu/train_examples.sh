#!/usr/bin/env bash
# Runs GPU example configs (configs/gpu/) for a few steps each with random weights of their shape
# (scripts/gpu/make_models.sh), after scripts/gpu/build.sh. Each run's log and metrics land in
# OUT/<config name>/; one JSON line per run (steps, and the mean seconds per step and per phase
# over steps 2 to N; in async runs 2 to N-1, since the last step has no next batch to score
# beside its training and would flatter the mean) goes to OUT/summary.jsonl. Runs that need more GPUs than the machine has
# are skipped, saying so. Timing runs: no checkpoints are written (a 7B PPO checkpoint with its
# optimizer states is ~240 GB).
#   scripts/gpu/train_examples.sh OUT STEPS NAME...      e.g. out/gpu 3 qwen2.5-0.5b-grpo-1gpu toy-1gpu
# NAME may carry overrides after a colon, KEY=VALUE separated by commas; the run's directory is
# named after the whole NAME:  qwen2.5-7b-grpo-4gpu:engines.count=1,engines.tp=2
# SET (environment) holds --set overrides for every run:  SET="--set rollout.max_new_tokens=512"
# NAME toy-1gpu: the quickstart's toy task with all 3 worker ranks on GPU 0 (cluster.ranks_per_gpu
# = 3, so the weight sync goes through the host); its reward must rise there too (30 steps).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=$1; steps=$2; shift 2
mkdir -p "$out"
cd "$tiller_root"
tiller=$gpu_build/bin/tiller
mpi=(mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
     -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH)
[ -n "${NCCL_DEBUG:-}" ] && mpi+=(-x NCCL_DEBUG)
[ -n "${PYTORCH_CUDA_ALLOC_CONF:-}" ] && mpi+=(-x PYTORCH_CUDA_ALLOC_CONF)
gpus=$(nvidia-smi -L | wc -l)
$python scripts/make_quickstart.py > /dev/null
read -r -a common_sets <<< "${SET:-}"
for name in "$@"; do
  dir=$out/${name//[:,=\/]/_}
  overrides=()
  if [[ $name == *:* ]]; then
    IFS=, read -r -a kvs <<< "${name#*:}"
    for kv in "${kvs[@]}"; do overrides+=(--set "$kv"); done
    name=${name%%:*}
  fi
  rm -rf "$dir"; mkdir -p "$dir"
  if [ "$name" = toy-1gpu ]; then
    cfg=configs/quickstart.yaml
    sets=(--set cluster.device=cuda --set cluster.backend=nccl --set cluster.ranks_per_gpu=3
          --set cluster.gpus_per_node=1 --set roles.actor.dtype=bf16 --set roles.critic.dtype=bf16
          --set roles.ref.dtype=bf16 --set engines.gpu_memory_fraction=0.3)
    np=4; need=1
  else
    cfg=configs/gpu/$name.yaml
    line=$(grep -m1 '^#   mpirun -np ' "$cfg")
    np=$(sed 's/.*-np \([0-9]*\).*/\1/' <<< "$line")
    need=$(grep -m1 '^#   tiller plan ' "$cfg" | sed 's/.*--gpus-per-node \([0-9]*\).*/\1/')
    sizes=$(grep -o 'models/qwen2.5-[0-9.]*b\(-rm\|-128k\)\?\|models/qwen3-30b-a3b-8l' "$cfg" | sed 's#models/qwen2.5-##; s#models/##' |
            sort -u | tr '\n' ' ')
    # shellcheck disable=SC2086
    bash scripts/gpu/make_models.sh $sizes
    sets=(--set train.num_steps="$steps")
    [ "$need" -eq 1 ] && sets+=(--set cluster.gpus_per_node=1)
  fi
  if [ "$need" -gt "$gpus" ]; then
    echo "{\"config\": \"$name\", \"skipped\": \"needs $need GPUs, this machine has $gpus\"}" | tee -a "$out/summary.jsonl"
    continue
  fi
  sets+=("${common_sets[@]}" "${overrides[@]}")
  visible=$(seq -s, 0 $((need - 1)))
  t0=$(date +%s)
  code=0
  CUDA_VISIBLE_DEVICES=$visible "${mpi[@]}" -x CUDA_VISIBLE_DEVICES -np "$np" "$tiller" train -c "$cfg" "${sets[@]}" \
    --set run.output_dir="$dir" --set checkpoint.dir= > "$dir/log.txt" 2>&1 || code=$?
  grep -E "step [0-9]+/|error|train.recompute:|efficiency \(" "$dir/log.txt" | cut -c1-400 | tail -6 || true
  $python - "${dir##*/}" "$dir" "$code" "$(( $(date +%s) - t0 ))" >> "$out/summary.jsonl" <<'PY'
import json, sys
name, d, code, wall = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = []
try:
    rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
except OSError:
    pass
out = {"config": name, "exit": code, "wall_s": wall, "steps": len(rows)}
if rows:
    # Step 1 warms up (CUDA graphs, allocations). An async run's last step trains without the
    # next step's samples arriving to be scored on the same ranks: leave it out when there are
    # steps enough (async runs record staleness/lag_1).
    later = rows[1:] or rows
    if any("staleness/lag_1" in r for r in rows) and len(rows) >= 4:
        later = rows[1:-1]
    avg = lambda k: round(sum(r.get(k, 0) for r in later) / len(later), 3)
    out.update({"steps_averaged": f"{rows.index(later[0]) + 1}-{rows.index(later[-1]) + 1}", "step_s": avg("time/step"), "generate_s": avg("time/generate"), "score_tail_s": avg("time/score_tail"),
                "train_s": avg("time/train"), "sync_s": avg("time/sync"),
                "gen_tok_per_s": round(avg("throughput/generate_tokens_per_s")),
                "train_tok_s_gpu": round(avg("throughput/train_tokens_per_s_per_gpu.actor")),
                "samples": avg("samples"), "tokens_per_sample": round(avg("prompt_length/mean") + avg("response_length/mean"), 1),
                "efficiency": {k[11:]: avg(k) for k in sorted(later[-1]) if k.startswith("efficiency/")},
                # GiB: each training role's device peak over the run, and the hybrid phases' peaks
                "device_peak_gb": {k[7:]: round(max(r.get(k, 0) for r in rows), 2) for k in sorted(rows[-1])
                                   if k.startswith("memory/") and "peak" in k and k.endswith("_gb")},
                "reward_first3": round(sum(r["reward/mean"] for r in rows[:3]) / len(rows[:3]), 3),
                "reward_last3": round(sum(r["reward/mean"] for r in rows[-3:]) / len(rows[-3:]), 3)})
print(json.dumps(out))
PY
  tail -1 "$out/summary.jsonl"
done
