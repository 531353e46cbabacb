#!/usr/bin/env bash
# On the GPU host: one engine at tensor parallelism 1, 2, 4 (tiller bench generate --tp, one rank
# per GPU under mpirun) on the same shape and batch, in the same run; reports each run's decode
# tokens/s, its step against the memory floor of one rank's share, and the ratio to TP 1.
#   MODEL=qwen2-7b BATCHES="64 256" TPS="1 2 4" PROMPT=128 NEW=512 scripts/gpu/bench_generate_tp.sh [OUT.json]
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
model=${MODEL:-qwen2-7b}
prompt=${PROMPT:-128}
new=${NEW:-512}
tmp=$(mktemp -d)
for b in ${BATCHES:-64 256}; do
  for tp in ${TPS:-1 2 4}; do
    id=$b-$tp
    if [ "$tp" = 1 ]; then
      "$gpu_build/bin/tiller" bench generate --model "$model" --batch "$b" --prompt-len "$prompt" --new-tokens "$new" \
        ${GEN_ARGS:-} --out "$tmp/$id.json" > /dev/null
    else
      mpirun -np "$tp" --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
        -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH "$gpu_build/bin/tiller" bench generate --model "$model" --tp "$tp" \
        --batch "$b" --prompt-len "$prompt" --new-tokens "$new" ${GEN_ARGS:-} --out "$tmp/$id.json" > /dev/null
    fi
    cat "$tmp/$id.json"
  done
done
$python - "$tmp" "$out" "$model" "${BATCHES:-64 256}" "${TPS:-1 2 4}" "$prompt" "$new" <<'PY'
import json, sys, datetime
tmp, out, model, batches, tps, prompt, new = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(), sys.argv[5].split(), sys.argv[6], sys.argv[7]
rows = []
for b in batches:
    base = json.load(open(f"{tmp}/{b}-1.json")) if "1" in tps else None
    for tp in tps:
        r = json.load(open(f"{tmp}/{b}-{tp}.json"))
        row = {"batch": int(b), "tp": int(tp), "decode_tokens_per_s": round(r["decode_tokens_per_s"]),
               "tokens_per_s": round(r["tokens_per_s"]), "step_ms": round(r["step_ms"], 3),
               "x_floor": round(r["x_floor"], 2), "prefill_s": round(r["prefill_s"], 3)}
        if base:
            row["decode_vs_tp1"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        rows.append(row)
res = {"bench": "generate_tp", "date": datetime.date.today().isoformat(), "model": model, "prompt": int(prompt), "new_tokens": int(new),
       "results": rows}
text = json.dumps(res)
print(text)
if out:
    open(out, "w").write(text + "\n")
PY
