#!/usr/bin/env bash
# On the GPU host, one GPU: decode attention's one-warp items (EngineOptions::decode_pack_keys)
# against four warps an item (--decode-pack-keys 0), each shape's two runs back to back in one
# call, one JSON line per run (the tag names model, batch, prompt and setting) into OUT.jsonl.
#   MODELS="0.5b 1.5b 7b" BATCHES="64 256" PROMPT=128 NEW=256 PACKS="0 512" scripts/gpu/bench_decode_pack.sh OUT.jsonl
# EXTRA="--fp8 --fp8-scaling tensor" adds an FP8 engine to each run; DEVICE=cpu and MODELS=tiny-qwen2
# check the script on a CPU (a name with a '-' is taken whole, else it is qwen2-NAME).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:?usage: bench_decode_pack.sh OUT.jsonl}
: > "$out"
for m in ${MODELS:-0.5b 1.5b 7b}; do
  model=$m; [[ $m == *-* ]] || model=qwen2-$m
  for b in ${BATCHES:-64 256}; do
    for pk in ${PACKS:-0 512}; do
      tag=$model-b$b-p${PROMPT:-128}-pk$pk
      json=$("$gpu_build/bin/tiller" bench generate --model "$model" --batch "$b" --prompt-len "${PROMPT:-128}" \
        --new-tokens "${NEW:-256}" --decode-pack-keys "$pk" --device "${DEVICE:-auto}" ${EXTRA:-} | grep '^{' | tail -1)
      printf '{"tag":"%s","result":%s}\n' "$tag" "$json" >> "$out"
      $python - "$tag" "$json" <<'PY'
import json, sys
d = json.loads(sys.argv[2])
runs = [(k, d[k]) for k in ("bf16", "fp8") if k in d] or [("run", d)]
print(sys.argv[1], "; ".join(f"{k} {r['decode_tokens_per_s']:.0f} tok/s, median step {r['step_ms_median']:.3f} ms" for k, r in runs))
PY
    done
  done
done
