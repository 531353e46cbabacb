#!/usr/bin/env bash
# On the GPU host, one GPU: what each FP8 engine scaling costs in engine/trainer mismatch on a
# trained model (docs/engine.md, FP8 engines). The tool-use example's SFT model (examples/tool_use),
# then STEPS GRPO steps from it with the bf16 engine and with the FP8 engine in each of SCALINGS,
# one job after another (jobs sharing the GPU starve each other's harnesses), and a summary per
# engine: mismatch/kl (mean, largest), the median of mismatch/max_abs_logp_diff and the rewards.
#   STEPS=10 SCALINGS="block tensor" scripts/gpu/fp8_mismatch.sh [OUT_DIR]
# SFT_DIR=DIR reuses a finished SFT stage (DIR/data, DIR/sft). Refuses an SFT model whose last eval
# loss is above MAX_SFT_LOSS (0.15: one that never learned to call the tool, so every reward would
# be 0). DATA_ARGS, SFT_ARGS and GRPO_ARGS add to the stages (the CPU check of this script runs the
# example's SMOKE sizes through them).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-/tmp/fp8_mismatch}
sft_dir=${SFT_DIR:-$out}
tiller=$gpu_build/bin/tiller
mpirun=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0 -x TORCH_SYMM_MEM_DISABLE_MULTICAST=1
        -x NVSHMEM_DISABLE_NVLS=1 -x PYTHONPATH)
if ! $python -c 'import openai' 2>/dev/null; then  # the harness's client, from scripts/gpu/fetch_debs.sh's wheels
  $python -m pip install -q --no-index --no-deps --target /tmp/openai-site "$tiller_root"/.gpu/wheels/*.whl
  export PYTHONPATH=/tmp/openai-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:-}
mkdir -p "$out"
cd "$tiller_root"
if [ ! -d "$sft_dir/sft/model" ]; then
  $python examples/tool_use/make_data.py "$sft_dir/data" ${DATA_ARGS:---train 40000 --rl 20000 --eval 500 --shape small} \
    > "$sft_dir/data.json"
  "${mpirun[@]}" -np 1 "$tiller" sft -c examples/tool_use/sft.yaml --set run.output_dir="$sft_dir/sft" \
    --set roles.actor.model="$sft_dir/data/model" --set offline.data="$sft_dir/data/sft.jsonl" ${SFT_ARGS:-} \
    > "$out/sft.log" 2>&1 || { tail -5 "$out/sft.log"; exit 1; }
fi
$python - "$sft_dir/sft/metrics.jsonl" "${MAX_SFT_LOSS:-0.15}" <<'PY'
import json, sys
losses = [json.loads(l)["eval/loss"] for l in open(sys.argv[1]) if "eval/loss" in l]
print(f"sft: last eval loss {losses[-1]:.4f}")
if losses[-1] > float(sys.argv[2]):
    sys.exit(f"fp8_mismatch: the SFT model stayed on its plateau (eval loss {losses[-1]:.3f}, above {sys.argv[2]}: "
             "GRPO from it scores no reward; docs/agents.md); run again, with SFT_ARGS='--set offline.max_steps=N' for more steps")
PY
for engine in bf16 ${SCALINGS:-block tensor}; do
  extra=()
  [ "$engine" != bf16 ] && extra=(--set engines.quantization=fp8 --set engines.fp8_scaling="$engine")
  "${mpirun[@]}" -np 2 "$tiller" train -c examples/tool_use/grpo.yaml --set run.output_dir="$out/$engine" \
    --set roles.actor.model="$sft_dir/sft/model" --set data.prompts="$sft_dir/data/rl.jsonl" \
    --set checkpoint.dir="$out/$engine/checkpoints" --set checkpoint.save_hf=false --set checkpoint.every_steps=1000 \
    --set train.num_steps="${STEPS:-10}" "${extra[@]}" ${GRPO_ARGS:-} > "$out/$engine.log" 2>&1 ||
    { tail -5 "$out/$engine.log"; exit 1; }
done
$python - "$out" bf16 ${SCALINGS:-block tensor} <<'PY'
import json, statistics, sys
out = sys.argv[1]
for engine in sys.argv[2:]:
    rows = [json.loads(l) for l in open(f"{out}/{engine}/metrics.jsonl")]
    rows = [r for r in rows if "mismatch/kl" in r]
    kl = [r["mismatch/kl"] for r in rows]
    print(json.dumps({"engine": engine, "steps": len(rows), "mismatch_kl_mean": statistics.mean(kl),
                      "mismatch_kl_max": max(kl),
                      "max_abs_logp_diff_median": statistics.median(r["mismatch/max_abs_logp_diff"] for r in rows),
                      "reward": [round(r["reward/mean"], 4) for r in rows]}))
PY
