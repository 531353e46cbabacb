#!/usr/bin/env bash
# A GPU example of an agent that learns to use a tool (docs/agents.md, "The tool-use example"): a
# ~9.5M-parameter Qwen2-shaped model from random weights learns, by tiller sft on conversations in
# the calculator harness's own format (examples/agents/calculator.py), to call the `calculate` tool
# for half of its 3-digit multiplications; then GRPO through `rollout.loop: openai_agent`, the
# harness talking to the job's engine with the `openai` client, teaches it to call the tool every
# time and copy its numbers right. One GPU, a few minutes:
#   examples/tool_use/run.sh [OUT]          (default out/tool_use; prints one JSON line)
# eval.py measures the greedy held-out accuracy and tool-call rate through `tiller engine
# --openai-port` before and after GRPO. SMOKE=1 runs the same pipeline on CPU at toy scale (a
# 2-layer model, a few steps): the CI test that keeps the example working, not that it learns.
# GRPO_ARGS adds settings to the GRPO stage.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-out/tool_use}
tiller=${TILLER:-build/bin/tiller}
mpirun=(${MPIRUN:-mpirun} --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0 -x TORCH_SYMM_MEM_DISABLE_MULTICAST=1
        -x NVSHMEM_DISABLE_NVLS=1)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
data=(--train 40000 --rl 20000 --eval 500 --shape small)
sft=(--set run.output_dir="$out/sft" --set roles.actor.model="$out/data/model" --set offline.data="$out/data/sft.jsonl")
grpo=(--set run.output_dir="$out/grpo" --set roles.actor.model="$out/sft/model" --set data.prompts="$out/data/rl.jsonl"
      --set checkpoint.dir="$out/grpo/checkpoints" --set checkpoint.save_hf=true)
read -r -a grpo_extra <<< "${GRPO_ARGS:-}"
device=cuda:0
limit=0
if [ "${SMOKE:-0}" = 1 ]; then
  data=(--train 400 --rl 200 --eval 16 --shape tiny)
  sft+=(--set cluster.device=cpu --set roles.actor.dtype=fp32 --set offline.max_steps=4 --set offline.eval_samples=32
        --set offline.eval_every=2 --set train.train_batch_size=64)
  grpo+=(--set cluster.device=cpu --set roles.actor.dtype=fp32 --set roles.ref.dtype=fp32 --set train.num_steps=2
         --set rollout.batch_size=4 --set rollout.n_samples_per_prompt=4 --set train.train_batch_size=16
         --set engines.max_num_seqs=32 --set agent.concurrency=16 --set checkpoint.every_steps=2
         --set engines.kv_cache_gb=0.0625)  # not the CPU's default 1 GiB, zeroed at every wake
  device=cpu
  limit=16
fi
rm -rf "$out/sft" "$out/grpo"
mkdir -p "$out"
t0=$(date +%s)
python3 examples/tool_use/make_data.py "$out/data" "${data[@]}" > "$out/data.json"
echo "data: $(cut -c1-200 "$out/data.json")"
"${mpirun[@]}" -np 1 "$tiller" sft -c examples/tool_use/sft.yaml "${sft[@]}" > "$out/sft.log" 2>&1 ||
  { tail -20 "$out/sft.log"; exit 1; }
t1=$(date +%s)
evaluate() {  # model-dir -> one JSON line
  python3 examples/tool_use/eval.py "$tiller" "$1" "$out/data/eval.jsonl" --device "$device" --limit "$limit"
}
evaluate "$out/sft/model" > "$out/eval_sft.json"
echo "after sft ($((t1 - t0)) s): $(cat "$out/eval_sft.json")"
"${mpirun[@]}" -np 2 "$tiller" train -c examples/tool_use/grpo.yaml "${grpo[@]}" "${grpo_extra[@]}" > "$out/grpo.log" 2>&1 ||
  { tail -20 "$out/grpo.log"; exit 1; }
t2=$(date +%s)
cks=("$out"/grpo/checkpoints/step_*)
evaluate "${cks[-1]}/actor_hf" > "$out/eval_grpo.json"
echo "after grpo ($((t2 - t1)) s): $(cat "$out/eval_grpo.json")"
python3 - "$out" "$((t1 - t0))" "$((t2 - t1))" <<'PY'
import json, sys
out, sft_s, grpo_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
grpo = [json.loads(l) for l in open(f"{out}/grpo/metrics.jsonl")]
# The harness got the record's question (not the chat-templated prompt) and made its own messages.
first = json.loads(open(f"{out}/grpo/samples.jsonl").readline())["prompt"]
if first.count("<|im_start|>user") != 1 or "<|im_start|>user\nWhat is " not in first:
    sys.exit(f"tool_use: the first GRPO sample's prompt is not the harness's conversation: {first!r}")
sft = [json.loads(l) for l in open(f"{out}/sft/metrics.jsonl")]
print(json.dumps({
    "after_sft": json.load(open(f"{out}/eval_sft.json")), "after_grpo": json.load(open(f"{out}/eval_grpo.json")),
    "sft_eval_loss": [[r["step"], round(r["eval/loss"], 4)] for r in sft if "eval/loss" in r],
    "grpo_reward_per_step": [round(r["reward/mean"], 4) for r in grpo if "reward/mean" in r],
    "grpo_turns_per_step": [round(r["turns/mean"], 3) for r in grpo if "turns/mean" in r],
    "agent_drifts": sum(r.get("agent/drifts", 0) for r in grpo),
    "sft_seconds": sft_s, "grpo_seconds": grpo_s}))
PY
