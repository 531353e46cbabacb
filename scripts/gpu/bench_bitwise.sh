#!/usr/bin/env bash
# On the GPU host, one GPU, after scripts/gpu/build.sh: what algo.logprob_match = bitwise costs,
# each benchmark run with the default kernels and with the batch-invariant ones in the same call
# (--logprob-match off | bitwise): decode tokens/s at batch 64 and 256 and one prefill of
# batch x 128 tokens (tiller bench generate, 256 new tokens), the forward and forward+backward
# (tiller bench forward, 2 x 2048 tokens), scoring and training steps of 4 x 2048 tokens (tiller
# bench train [--score], one rank). Prints one line per row with the ratio bitwise / off.
#   MODELS="0.5b 1.5b 7b" scripts/gpu/bench_bitwise.sh [OUT.jsonl]
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
models=${MODELS:-0.5b 1.5b 7b}
tiller=$gpu_build/bin/tiller
mpi=(mpirun --allow-run-as-root -np 1 -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS
     -x LD_LIBRARY_PATH)
tmp=$(mktemp -d)
for lm in off bitwise; do
  for m in $models; do
    for b in 64 256; do
      "$tiller" bench generate --model "qwen2-$m" --batch "$b" --prompt-len 128 --new-tokens 256 --logprob-match $lm \
        --out "$tmp/gen-$m-$b-$lm.json" > /dev/null
    done
  done
  "$tiller" bench forward --model "$(echo $models | sed 's/\([^ ]*\)/qwen2-\1/g; s/ /,/g')" --seq 2048 --micro-batch 2 \
    --logprob-match $lm --out "$tmp/fwd-$lm.json" > /dev/null
  "${mpi[@]}" "$tiller" bench train --model qwen2-1.5b --seq 2048 --micro-batch 4 --steps 5 --score --logprob-match $lm \
    --out "$tmp/score-$lm.json" > /dev/null
  "${mpi[@]}" "$tiller" bench train --model qwen2-1.5b --seq 2048 --micro-batch 4 --steps 5 --logprob-match $lm \
    --out "$tmp/train-$lm.json" > /dev/null
done
$python - "$tmp" "$out" $models <<'PY'
import json, sys, datetime
tmp, out, models = sys.argv[1], sys.argv[2], sys.argv[3:]
load = lambda name: json.load(open(f"{tmp}/{name}.json"))
rows = []
def row(what, off, bitwise):
    rows.append({"row": what, "off": off, "bitwise": bitwise, "ratio": bitwise / off})
for m in models:
    for b in (64, 256):
        o, w = load(f"gen-{m}-{b}-off"), load(f"gen-{m}-{b}-bitwise")
        row(f"decode tokens/s {m} batch {b}", o["decode_tokens_per_s"], w["decode_tokens_per_s"])
        row(f"prefill tokens/s {m} {b}x128", b * 128 / o["prefill_s"], b * 128 / w["prefill_s"])
o, w = load("fwd-off"), load("fwd-bitwise")
for a, b in zip(o["results"], w["results"]):
    row(f"forward tokens/s {a['model']}", a["forward"]["tokens_per_s"], b["forward"]["tokens_per_s"])
    row(f"forward+backward tokens/s {a['model']}", a["forward_backward"]["tokens_per_s"],
        b["forward_backward"]["tokens_per_s"])
for kind in ("score", "train"):
    row(f"{kind} tokens/s/GPU qwen2-1.5b", load(f"{kind}-off")["tokens_per_s_per_gpu"],
        load(f"{kind}-bitwise")["tokens_per_s_per_gpu"])
date = datetime.date.today().isoformat()
for r in rows:
    r["date"] = date
    print(f"{r['row']:45s} off {r['off']:12.0f}  bitwise {r['bitwise']:12.0f}  ratio {r['ratio']:.3f}")
if out:
    with open(out, "w") as f:
        for r in rows: f.write(json.dumps(r) + "\n")
PY
