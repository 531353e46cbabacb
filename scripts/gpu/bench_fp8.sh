#!/usr/bin/env bash
# On the GPU host, one GPU: the FP8 engine against the bf16 engine on the same random weights, in
# one `tiller bench generate --fp8` run per shape (docs/engine.md, FP8 engines), and a summary table.
#   MODELS="0.5b 1.5b 7b" BATCHES="64 256" SCALINGS="channel block tensor" PROMPT=128 NEW=256 scripts/gpu/bench_fp8.sh [OUT.jsonl]
# GEN_ARGS="--fp8-unfused" with SCALINGS=tensor also measures the FP8 engine one linear at a time
# (its quantization not fused into the norms and SwiGLU) between the two, as the "unfused" column.
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-$(mktemp)}
: > "$out"
for sc in ${SCALINGS:-block}; do
for m in ${MODELS:-0.5b 1.5b 7b}; do
  for b in ${BATCHES:-64 256}; do
    "$gpu_build/bin/tiller" bench generate --fp8 --fp8-scaling "$sc" --model "qwen2-$m" --batch "$b" \
      --prompt-len "${PROMPT:-128}" --new-tokens "${NEW:-256}" ${GEN_ARGS:-} >> "$out"
  done
done
done
$python - "$out" <<'PY'
import json, sys
print(f"{'scales':>8} {'model':>12} {'batch':>5} {'bf16 tok/s':>11} {'unfused':>8} {'fp8 tok/s':>10} {'decode x':>8} {'bf16 x floor':>12} {'fp8 x floor':>11} {'tensor cores':>12}")
for line in open(sys.argv[1]):
    j = json.loads(line)
    b, f = j["bf16"], j["fp8"]
    u = f"{j['fp8_unfused']['decode_tokens_per_s']:.0f}" if "fp8_unfused" in j else "-"
    print(f"{f.get('fp8_scaling', 'block'):>8} {b['model']:>12} {b['batch']:>5} {b['decode_tokens_per_s']:>11.0f} {u:>8} {f['decode_tokens_per_s']:>10.0f} "
          f"{j['fp8_decode_speedup']:>8.2f} {b['x_floor']:>12.2f} {f['x_floor']:>11.2f} {str(f['fp8_tensor_cores']):>12}")
PY
