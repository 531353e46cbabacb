#!/usr/bin/env bash
# A GPU example that learns a real task (docs/offline.md, "The arithmetic example"): a ~76M-parameter
# Qwen2-shaped model learns multi-digit addition from random weights with tiller sft, then GRPO
# with a rule reward raises its greedy accuracy on held-out problems. One GPU, a few minutes:
#   examples/arithmetic/run.sh [OUT]          (default out/arithmetic; prints one JSON line: the curve)
# SMOKE=1 runs the same pipeline on CPU at toy scale (2-digit problems, a 2-layer model, a few steps):
# the CI test that keeps the example working; it checks that it runs, not that it learns.
# GRPO_ARGS adds settings to the GRPO stage, and FROM_SFT=DIR starts it from an earlier run's data
# and SFT model (DIR/data, DIR/sft) instead of making them again: the same SFT model trained with
# another engine, e.g. an FP8 one with TIS beside the bf16 run in DIR (docs/engine.md, FP8 engines):
#   FROM_SFT=out/arithmetic GRPO_ARGS="--set engines.quantization=fp8 --set algo.importance_correction=tis
#     --set algo.tis_cap=2" examples/arithmetic/run.sh out/arithmetic-fp8
# On-policy distillation (docs/training.md): SHAPE=small|mini makes a ~9.5M|~3M-parameter model (the
# same tokenizer), and TEACHER=DIR (an HF model: an earlier run's final GRPO checkpoint) makes the GRPO
# stage distill from it (the reference role; algo.distill_coef DISTILL_COEF, default 1, beside the
# task reward; kl_coef 0). The student without the teacher is the control:
#   SHAPE=small examples/arithmetic/run.sh out/small      (the teacher)
#   TEACHER=out/small/grpo/checkpoints/step_000500/actor_hf SHAPE=mini examples/arithmetic/run.sh out/distill
#   SHAPE=mini examples/arithmetic/run.sh out/mini
# EVAL_CHECKPOINTS=last: eval.py measures only the final checkpoint (default all: every kept one).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-out/arithmetic}
tiller=${TILLER:-build/bin/tiller}
mpirun=(${MPIRUN:-mpirun} --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0 -x TORCH_SYMM_MEM_DISABLE_MULTICAST=1
        -x NVSHMEM_DISABLE_NVLS=1)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
data=(--digits 4 --train 200000 --eval 1000 --shape "${SHAPE:-base}")
sft=(--set run.output_dir="$out/sft" --set roles.actor.model="$out/data/model" --set offline.data="$out/data/sft.jsonl")
grpo=(--set run.output_dir="$out/grpo" --set roles.actor.model="$out/sft/model" --set data.prompts="$out/data/rl.jsonl"
      --set eval.prompts="$out/data/eval.jsonl")
read -r -a grpo_extra <<< "${GRPO_ARGS:-}"
if [ -n "${TEACHER:-}" ]; then
  [ -f "$TEACHER/config.json" ] || { echo "run.sh: TEACHER=$TEACHER is not an HF model directory (no config.json)" >&2; exit 2; }
  grpo_extra+=(--set roles.ref.model="$TEACHER" --set algo.distill_coef="${DISTILL_COEF:-1}" --set algo.kl_coef=0)
fi
if [ "${SMOKE:-0}" = 1 ]; then
  data=(--digits 2 --train 2000 --eval 50 --shape "${SHAPE:-tiny}")
  sft+=(--set cluster.device=cpu --set roles.actor.dtype=fp32 --set offline.epochs=1 --set offline.max_steps=6
        --set offline.eval_samples=50 --set offline.eval_every=3)
  grpo+=(--set cluster.device=cpu --set roles.actor.dtype=fp32 --set roles.ref.dtype=fp32 --set train.num_steps=2
         --set rollout.batch_size=8 --set rollout.max_new_tokens=24 --set train.train_batch_size=64
         --set engines.max_num_seqs=64 --set eval.every_steps=1 --set eval.max_new_tokens=24
         --set engines.kv_cache_gb=0.0625)  # not the CPU's default 1 GiB, zeroed at every wake
fi
if [ -n "${FROM_SFT:-}" ] && [ "$(cd "$FROM_SFT" 2>/dev/null && pwd)" = "$(mkdir -p "$out" && cd "$out" && pwd)" ]; then
  echo "run.sh: FROM_SFT must be another run's directory, not the output $out" >&2
  exit 2
fi
# A rerun starts over: tiller resumes from a checkpoint it finds, which would skip the stages.
rm -rf "$out/sft" "$out/grpo"
mkdir -p "$out"
t0=$(date +%s)
if [ -n "${FROM_SFT:-}" ]; then
  [ -d "$FROM_SFT/sft/model" ] && [ -d "$FROM_SFT/data" ] ||
    { echo "run.sh: FROM_SFT=$FROM_SFT has no sft/model or data/ (run the example there first)" >&2; exit 2; }
  rm -rf "$out/data"
  cp -r "$FROM_SFT/data" "$out/data"
  cp "$FROM_SFT/data.json" "$out/data.json"
  mkdir -p "$out/sft"
  cp -r "$FROM_SFT/sft/model" "$out/sft/model"
  cp "$FROM_SFT/sft/metrics.jsonl" "$out/sft/metrics.jsonl"
  echo "data and sft: from $FROM_SFT"
else
  python3 examples/arithmetic/make_data.py "$out/data" "${data[@]}" > "$out/data.json"
  echo "data: $(cut -c1-200 "$out/data.json")"
  "${mpirun[@]}" -np 1 "$tiller" sft -c examples/arithmetic/sft.yaml "${sft[@]}" > "$out/sft.log" 2>&1 ||
    { tail -20 "$out/sft.log"; exit 1; }
fi
t1=$(date +%s)
eval_args=(--max-new-tokens 64)
[ "${SMOKE:-0}" = 1 ] && eval_args=(--max-new-tokens 24)
python3 examples/arithmetic/eval.py "$out/data/model" "$out/data/eval.jsonl" "${eval_args[@]}" > "$out/eval_random.json"
python3 examples/arithmetic/eval.py "$out/sft/model" "$out/data/eval.jsonl" "${eval_args[@]}" > "$out/eval_sft.json"
echo "after sft ($((t1 - t0)) s): $(cut -c1-300 "$out/eval_sft.json")"
"${mpirun[@]}" -np 2 "$tiller" train -c examples/arithmetic/grpo.yaml "${grpo[@]}" "${grpo_extra[@]}" \
  --set checkpoint.dir="$out/grpo/checkpoints" --set checkpoint.save_hf=true > "$out/grpo.log" 2>&1 ||
  { tail -20 "$out/grpo.log"; exit 1; }
t2=$(date +%s)
# Each kept checkpoint's actor (every 50 steps, as eval.every_steps), exported as an HF directory (checkpoint.save_hf);
# the last one is the final model. EVAL_CHECKPOINTS=last checks only that one (tiller train's own evaluation has the
# curve; eval.py's pass over every checkpoint takes longer than the GRPO stage).
cks=("$out"/grpo/checkpoints/step_*)
[ "${EVAL_CHECKPOINTS:-all}" = last ] && cks=("${cks[-1]}")
for ck in "${cks[@]}"; do
  python3 examples/arithmetic/eval.py "$ck/actor_hf" "$out/data/eval.jsonl" "${eval_args[@]}" \
    > "$out/eval_grpo_$(basename "$ck").json"
  cp "$out/eval_grpo_$(basename "$ck").json" "$out/eval_grpo.json"
done
echo "after grpo ($((t2 - t1)) s): $(cut -c1-300 "$out/eval_grpo.json")"
python3 - "$out" "$((t1 - t0))" "$((t2 - t1))" <<'PY'
import glob, json, os, sys
out, sft_s, grpo_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sft = [json.loads(l) for l in open(f"{out}/sft/metrics.jsonl")]
grpo = [json.loads(l) for l in open(f"{out}/grpo/metrics.jsonl")]
curve = {
    "accuracy_random": json.load(open(f"{out}/eval_random.json"))["accuracy"],
    "accuracy_after_sft": json.load(open(f"{out}/eval_sft.json"))["accuracy"],
    "accuracy_after_grpo": json.load(open(f"{out}/eval_grpo.json"))["accuracy"],
    "grpo_accuracy_by_step": [[int(os.path.basename(p)[len("eval_grpo_step_"):-5]), json.load(open(p))["accuracy"]]
                              for p in sorted(glob.glob(f"{out}/eval_grpo_step_*.json"))],
    "sft_eval_loss": [[r["step"], round(r["eval/loss"], 4)] for r in sft if "eval/loss" in r],
    "grpo_reward_per_step": [round(r["reward/mean"], 4) for r in grpo if "reward/mean" in r],
    "sft_seconds": sft_s, "grpo_seconds": grpo_s,
}
if any("distill/reverse_kl" in r for r in grpo):  # TEACHER: the student's per-token reverse KL to it
    curve["teacher"] = os.environ.get("TEACHER", "")
    curve["distill_reverse_kl_per_step"] = [round(r["distill/reverse_kl"], 4) for r in grpo if "distill/reverse_kl" in r]
elif os.environ.get("TEACHER"):
    sys.exit("run.sh: TEACHER is set, yet the GRPO stage logged no distill/reverse_kl")
# The same curve from tiller train's own evaluation (eval.*: the engine, greedy, every 50 steps;
# step 0 is the SFT model), and its difference from eval.py's at the steps both measured.
train_eval = {r["step"]: r["eval/all/greedy_accuracy"] for r in grpo if "eval/all/greedy_accuracy" in r}
curve["train_eval_greedy_by_step"] = sorted([s, round(a, 4)] for s, a in train_eval.items())
script = dict(curve["grpo_accuracy_by_step"])
script[0] = curve["accuracy_after_sft"]
both = sorted(set(script) & set(train_eval))
curve["train_eval_minus_script"] = [[s, round(train_eval[s] - script[s], 4)] for s in both]
if not both:
    sys.exit("run.sh: tiller train logged no eval/all/greedy_accuracy at a step eval.py measured")
print(json.dumps(curve))
PY
