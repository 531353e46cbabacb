#!/usr/bin/env bash
# plan_examples.sh TILLER [SCRATCH]: every GPU example config (configs/gpu/*.yaml) and every config
# for real models (configs/real/*.yaml) loads, passes the config check, and plans on the layout its
# header names ("#   tiller plan -c FILE --nodes N ..."). The models' shapes (config.json alone, from
# tiller init-model --config-only) are written under SCRATCH/models, and for configs/real, which
# name hub ids, into a Hugging Face cache laid out under SCRATCH/hub (HF_HUB_CACHE), so the memory
# plan runs too: a header that names --gpu-memory-gb must fit it.
set -euo pipefail
tiller=$(realpath "$1")
repo=$(cd "$(dirname "$0")/../.." && pwd)
scratch=${2:-$(mktemp -d)}
mkdir -p "$scratch"
cd "$scratch"
for spec in 0.5b 1.5b 7b 32b 72b 1.5b-rm 7b-rm; do
  size=${spec%-rm}
  flags=(--config-only)
  [ "$spec" != "$size" ] && flags+=(--value-head)
  "$tiller" init-model --preset "qwen2-$size" --out "models/qwen2.5-$spec" "${flags[@]}" > /dev/null
done
for size in 1.5b 7b; do  # 128k positions (YaRN by 4): the long-sample configs
  "$tiller" init-model --preset "qwen2-$size" --out "models/qwen2.5-$size-128k" --config-only --rope-yarn 4 > /dev/null
done
"$tiller" init-model --preset qwen3-30b-a3b-8l --out models/qwen3-30b-a3b-8l --config-only > /dev/null
# The hub models of configs/real, as huggingface_hub lays them out (refs/main -> snapshots/<commit>):
# the Qwen2.5 shapes from the presets, Llama-3.1-8B and its reward model from their published
# config.json.
export HF_HUB_CACHE=$scratch/hub
commit=0123456789abcdef0123456789abcdef01234567
snapshot() {  # REPO -> its snapshot folder, created
  local d="$HF_HUB_CACHE/models--${1/\//--}"
  mkdir -p "$d/refs" "$d/snapshots/$commit"
  printf '%s' "$commit" > "$d/refs/main"
  echo "$d/snapshots/$commit"
}
"$tiller" init-model --preset qwen2-0.5b --out "$(snapshot Qwen/Qwen2.5-0.5B-Instruct)" --config-only > /dev/null
"$tiller" init-model --preset qwen2-7b --out "$(snapshot Qwen/Qwen2.5-7B-Instruct)" --config-only > /dev/null
python3 - "$(snapshot meta-llama/Llama-3.1-8B-Instruct)" "$(snapshot Skywork/Skywork-Reward-Llama-3.1-8B-v0.2)" <<'PY'
import json, sys
llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
         "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}}
json.dump(llama, open(f"{sys.argv[1]}/config.json", "w"))
json.dump(dict(llama, architectures=["LlamaForSequenceClassification"], num_labels=1, eos_token_id=128009),
          open(f"{sys.argv[2]}/config.json", "w"))
PY
n=0
for f in "$repo"/configs/gpu/*.yaml "$repo"/configs/real/*.yaml; do
  line=$(grep -m1 '^#   tiller plan ' "$f" | sed 's/^#   tiller plan //; s/ *#.*$//') || true
  [ -n "$line" ] || { echo "FAIL: $f names no '#   tiller plan' layout in its header" >&2; exit 1; }
  line=${line//configs\/gpu\//$repo/configs/gpu/}
  line=${line//configs\/real\//$repo/configs/real/}
  # shellcheck disable=SC2086
  out=$("$tiller" plan $line 2>&1) || { echo "FAIL: tiller plan $line:" >&2; echo "$out" >&2; exit 1; }
  grep -q "^launch:" <<< "$out" || { echo "FAIL: no launch line for $f" >&2; exit 1; }
  grep -q "^memory per rank" <<< "$out" || { echo "FAIL: no memory plan for $f:" >&2; echo "$out" >&2; exit 1; }
  if [[ $line == *--gpu-memory-gb* ]] && ! grep -q "  fits$" <<< "$out"; then
    echo "FAIL: $f names a GPU size but its memory plan gives no verdict:" >&2; echo "$out" >&2; exit 1
  fi
  echo "$(basename "$f"): $(head -1 <<< "$out" | sed 's/^# [^:]*: //')"
  n=$((n + 1))
done
echo "$n example configs plan (configs/gpu and configs/real)"

# What does not fit is refused with the smallest layout that does: the 72B LoRA example on 80 GB
# GPUs (no room for a KV cache beside the base and its engine slice), and full-weight 72B, whose
# AdamW state on the host (872 GB) is more than one 4-GPU host's 512 GiB.
expect_refusal() {  # PATTERN ARGS... (CONFIG: the config's name, the 72B LoRA 4-GPU example by default)
  local pattern=$1; shift
  local out code=0
  out=$("$tiller" plan -c "$repo/configs/gpu/${CONFIG:-qwen2.5-72b-lora-grpo-hybrid-4gpu}.yaml" --nodes 1 "$@" 2>&1) || code=$?
  if [ "$code" -ne 2 ] || ! grep -Eq "$pattern" <<< "$out"; then
    echo "FAIL: tiller plan $*: exit $code, expected 2 and /$pattern/:" >&2; echo "$out" | tail -5 >&2; exit 1
  fi
  echo "refused as expected: $(tail -1 <<< "$out" | grep -Eo "$pattern")"
}
# A sample longer than the model's context (128k on the 32k shape without its YaRN scaling) is
# refused by the plan, as tiller train refuses it at its start.
code=0
out=$("$tiller" plan -c "$repo/configs/gpu/qwen2.5-1.5b-grpo-long-hybrid-2gpu.yaml" --nodes 1 --gpus-per-node 2 \
      --set roles.actor.model=models/qwen2.5-1.5b 2>&1) || code=$?
if [ "$code" -ne 2 ] || ! grep -q "max_new_tokens = 131072 exceeds the context of models/qwen2.5-1.5b (32768 tokens" <<< "$out"; then
  echo "FAIL: the 128k config on the 32k model: exit $code, expected 2 and the context's refusal:" >&2
  echo "$out" | tail -3 >&2; exit 1
fi
echo "refused as expected: the 128k config on the 32k model"
# The 128k-sample layouts plan PyTorch's expandable segments (cluster.expandable_segments auto):
# in their sequence groups, beside activations of a GiB, the default allocator's holes would not fit
# an 80 GB GPU; the 1.5B GRPO example (no sequence groups) keeps the default.
for f in qwen2.5-1.5b-grpo-long-hybrid-2gpu:2 qwen2.5-7b-grpo-long-hybrid-4gpu:4 qwen2.5-1.5b-grpo-2gpu:2; do
  out=$("$tiller" plan -c "$repo/configs/gpu/${f%:*}.yaml" --nodes 1 --gpus-per-node "${f#*:}" --gpu-memory-gb 80 2>&1)
  want="cluster.expandable_segments: on (auto: rank"
  [[ $f == qwen2.5-1.5b-grpo-2gpu:* ]] && want="cluster.expandable_segments: off (auto: no sequence groups"
  grep -qF "$want" <<< "$out" || { echo "FAIL: ${f%:*} on 80 GB GPUs: no '$want' in its plan:" >&2; echo "$out" >&2; exit 1; }
  echo "${f%:*}: $(grep -o 'cluster.expandable_segments: [a-z]*' <<< "$out")"
done
expect_refusal "has no room for a KV cache.*The smallest layout that fits: 8 GPUs on 2 nodes of 4" \
  --gpus-per-node 4 --gpu-memory-gb 80 --host-memory-gb 512
expect_refusal "node 0 needs [0-9.]+ GiB of host memory.*The smallest layout that fits: 8 GPUs on 2 nodes of 4" \
  --gpus-per-node 4 --gpu-memory-gb 141 --host-memory-gb 512 --set roles.actor.lora.rank=0 \
  --set roles.actor.optimizer_offload=cpu --set roles.actor.offload=true
expect_refusal "The smallest layout that fits: 16 GPUs on 2 nodes of 8 .*roles.actor.optimizer_offload=cpu" \
  --gpus-per-node 8 --gpu-memory-gb 80 --host-memory-gb 560 --set roles.actor.lora.rank=0 --set roles.actor.gpus=8
# The 8-GPU examples (issue 63): the 32B full-weight job with engines at TP 2 (its config), 4 and 8
# all fit 80 GB GPUs; full-weight 72B on one 8-GPU host fits 141 GB GPUs with 2 TB of host memory
# (its config's header, planned above) and is refused on the 560 GiB hosts of the 8-GPU machines
# the device tool lends, naming 2 nodes.
for v in "4 2" "8 1"; do
  set -- $v
  out=$("$tiller" plan -c "$repo/configs/gpu/qwen2.5-32b-grpo-hybrid-8gpu.yaml" --nodes 1 --gpus-per-node 8 \
        --gpu-memory-gb 80 --host-memory-gb 512 --set engines.tp="$1" --set engines.count="$2" 2>&1) ||
    { echo "FAIL: the 32B 8-GPU example with engines at TP $1:" >&2; echo "$out" | tail -3 >&2; exit 1; }
  grep -q "(TP $1), inside the actor's processes" <<< "$out" && ! grep -q "DOES NOT FIT" <<< "$out" ||
    { echo "FAIL: the 32B 8-GPU example at TP $1 does not plan as $2 engine(s) that fit:" >&2; echo "$out" >&2; exit 1; }
  echo "qwen2.5-32b-grpo-hybrid-8gpu at TP $1: fits 80 GB"
done
CONFIG=qwen2.5-72b-grpo-hybrid-8gpu expect_refusal \
  "node 0 needs 8[0-9.]+ GiB of host memory.*The smallest layout that fits: 16 GPUs on 2 nodes of 8" \
  --gpus-per-node 8 --gpu-memory-gb 141 --host-memory-gb 560
