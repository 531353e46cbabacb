#!/usr/bin/env bash
# On the GPU host, N GPUs (default 2): the trainers' scoring pass (tiller bench train --score: the
# ZeRO-3 model over N ranks, forward without autograd, log-probs and entropies to the host) beside
# `tiller bench forward` (the plain model on one GPU) on the same shape, in the same run, and the
# ratio of tokens/s per GPU (issue 25's target: >= 0.85). The default shape is a GRPO step's
# scoring micro-batch: 25 sequences of 640 tokens (rollout.micro_batch_tokens 16384).
#   NGPU=2 MODELS="qwen2-1.5b qwen2-7b" SEQ=640 MBS=25 scripts/gpu/bench_score.sh [OUT.json]
# PROFILE_DIR=dir also writes a Chrome trace of rank 0's last scoring pass per model there.
# FROZEN=1 scores with a frozen model (the reference and reward roles; 7B then fits one GPU).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
n=${NGPU:-2}
mbs=${MBS:-25}
seq=${SEQ:-640}
tmp=$(mktemp -d)
for model in ${MODELS:-qwen2-1.5b qwen2-7b}; do
  "$gpu_build/bin/tiller" bench forward --model "$model" --seq "$seq" --micro-batch "$mbs" --out "$tmp/forward-$model.json" \
    > /dev/null
  mpirun -np "$n" --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
    -x NVSHMEM_DISABLE_NVLS "$gpu_build/bin/tiller" bench train --score --model "$model" --seq "$seq" \
    --micro-batch "$mbs" ${PROFILE_DIR:+--profile "$PROFILE_DIR/score-$model.json"} \
    $([ "${FROZEN:-0}" = 1 ] && echo --frozen) --out "$tmp/score-$model.json" \
    > /dev/null
done
$python - "$tmp" "$out" ${MODELS:-qwen2-1.5b qwen2-7b} <<'PY'
import json, sys, datetime
tmp, out, models = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = []
for m in models:
    f = json.load(open(f"{tmp}/forward-{m}.json"))["results"][0]["forward"]
    s = json.load(open(f"{tmp}/score-{m}.json"))
    rows.append({"model": m, "ratio_tokens_per_s": round(s["tokens_per_s_per_gpu"] / f["tokens_per_s"], 3),
                 "score": s, "forward": f})
res = {"bench": "score_vs_forward", "date": datetime.date.today().isoformat(), "results": rows}
text = json.dumps(res)
print(text)
if out:
    open(out, "w").write(text + "\n")
PY
