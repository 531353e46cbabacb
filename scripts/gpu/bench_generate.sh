#!/usr/bin/env bash
# On the GPU host, one GPU: tiller bench generate beside the two peers of issue 5 on the same
# shapes, in the same run: HF transformers generate (peer_bench.py gen) and a hand-tuned
# PyTorch decode loop in one CUDA graph (decode_peer.py). Copy both from ../shared/bench into
# .gpu/bench/ first (git-ignored; carry .gpu).
#   MODELS="0.5b 7b" BATCHES="64 256" PROMPT=128 NEW=256 HF=1 scripts/gpu/bench_generate.sh [OUT.json]
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
prompt=${PROMPT:-128}
new=${NEW:-256}
bench=$tiller_root/.gpu/bench
for f in peer_bench.py decode_peer.py; do
  [ -f "$bench/$f" ] || { echo "bench_generate.sh: $bench/$f is missing; copy it from ../shared/bench" >&2; exit 2; }
done
tmp=$(mktemp -d)
for m in ${MODELS:-0.5b 7b}; do
  for b in ${BATCHES:-64 256}; do
    "$gpu_build/bin/tiller" bench generate --model "qwen2-$m" --batch "$b" --prompt-len "$prompt" --new-tokens "$new" \
      ${GEN_ARGS:-} --out "$tmp/tiller-$m-$b.json" > /dev/null
    $python "$bench/decode_peer.py" "$m" "$b" "$prompt" "$new" | grep '^{' | tail -1 > "$tmp/graph-$m-$b.json"
    if [ "${HF:-1}" = 1 ]; then
      $python "$bench/peer_bench.py" gen "$m" "$b" "$prompt" "$new" | grep '^{' | tail -1 > "$tmp/hf-$m-$b.json"
    fi
    cat "$tmp/tiller-$m-$b.json" "$tmp/graph-$m-$b.json"
  done
done
$python - "$tmp" "$out" "${MODELS:-0.5b 7b}" "${BATCHES:-64 256}" <<'PY'
import json, os, sys, datetime
tmp, out, models, batches = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
rows = []
for m in models:
    for b in batches:
        t = json.load(open(f"{tmp}/tiller-{m}-{b}.json"))
        g = json.loads(open(f"{tmp}/graph-{m}-{b}.json").read())
        row = {"model": f"qwen2-{m}", "batch": int(b), "tiller": t, "cuda_graph_peer": g,
               "ratio_tokens_per_s_vs_graph": round(t["tokens_per_s"] / g["tokens_per_s"], 3),
               "ratio_step_vs_graph": round(g["step_ms"] / t["step_ms"], 3)}
        hf = f"{tmp}/hf-{m}-{b}.json"
        if os.path.exists(hf) and os.path.getsize(hf):
            h = json.loads(open(hf).read())
            row["hf_peer"] = h
            row["ratio_tokens_per_s_vs_hf"] = round(t["tokens_per_s"] / h["tokens_per_s"], 3)
        rows.append(row)
res = {"bench": "generate_vs_peers", "date": datetime.date.today().isoformat(), "results": rows}
text = json.dumps(res)
print(text)
if out:
    open(out, "w").write(text + "\n")
PY
