#!/usr/bin/env bash
# RLHF end to end on CPU, about half a minute on 2 cores (docs/offline.md, "RLHF end to end"):
#   1. tiller train-rm learns a reward model from preference pairs that a hidden rule labelled
#      (the response with more digits is chosen; scripts/make_sft_data.py);
#   2. tiller train runs PPO against that reward model; the hidden rule's score of the responses,
#      which PPO never sees, rises (examples/rlhf/hidden_score.py reads the rollout records);
#   3. tiller sft teaches the tiny model the toy task's answers, then GRPO starts from it.
# Usage (from the repository root, after the build):  examples/rlhf/run.sh [OUT]   (default out/rlhf)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-out/rlhf}
tiller=${TILLER:-build/bin/tiller}
mpirun=(${MPIRUN:-mpirun} --oversubscribe --allow-run-as-root)
python3 scripts/make_quickstart.py > /dev/null
python3 scripts/make_sft_data.py > /dev/null
rm -rf "$out"; mkdir -p "$out"

echo "== 1. reward model from preference pairs (tiller train-rm)"
"${mpirun[@]}" -np 1 "$tiller" train-rm -c configs/rm_quickstart.yaml --set run.output_dir="$out/rm" \
  --set checkpoint.dir= > "$out/rm.log" 2>&1
python3 - "$out/rm/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
print(f"   held-out accuracy of the reward model: {acc}")
assert acc[-1] > 0.8, "the reward model did not learn the rule"
PY

echo "== 2. PPO against the learned reward model (tiller train)"
"${mpirun[@]}" -np 4 "$tiller" train -c configs/rlhf_ppo.yaml --set run.output_dir="$out/ppo" \
  --set roles.reward.model="$out/rm/model" --set logging.rollout_records="$out/ppo/records.jsonl" > "$out/ppo.log" 2>&1
grep -E "step (1|30)/" "$out/ppo.log" | sed 's/^.*controller\] /   /' | cut -c1-80
python3 examples/rlhf/hidden_score.py "$out/ppo/records.jsonl" models/tiny-qwen2 --min-rise 0.2 | cut -c1-90

echo "== 3. SFT, then GRPO from the SFT model (tiller sft, tiller train)"
"${mpirun[@]}" -np 1 "$tiller" sft -c configs/sft_quickstart.yaml --set run.output_dir="$out/sft" \
  --set checkpoint.dir= > "$out/sft.log" 2>&1
"${mpirun[@]}" -np 3 "$tiller" train -c configs/rlhf_sft_grpo.yaml --set run.output_dir="$out/grpo" \
  --set roles.actor.model="$out/sft/model" > "$out/grpo.log" 2>&1
python3 - "$out/grpo/metrics.jsonl" <<'PY'
import json, sys
r = [json.loads(l)["reward/mean"] for l in open(sys.argv[1])]
first, last = sum(r[:3]) / 3, sum(r[-3:]) / 3
print(f"   GRPO from the SFT model: mean reward {first:.3f} (steps 1-3) -> {last:.3f} (last 3)")
assert first > 0.3 and last > 0.9, "GRPO from the SFT model did not start high and rise"
PY
echo "done: $out"
