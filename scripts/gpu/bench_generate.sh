#!/usr/bin/env bash
# On the GPU host, one GPU: tiller bench generate beside the two peers of issue 5 on the same
# shapes, in the same run: HF transformers generate (peer_bench.py gen) and a hand-tuned
# PyTorch decode loop in one CUDA graph (decode_peer.py). Copy both from ../shared/bench into
# .gpu/bench/ first (git-ignored; carry .gpu).
#   MODELS="0.5b 7b" BATCHES="64 256" PROMPT=128 NEWS="256 1024" HF=1 scripts/gpu/bench_generate.sh [OUT.json]
# PROFILE_DIR=dir also writes a Chrome trace of 5 decode steps per tiller run there.
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
prompt=${PROMPT:-128}
news=${NEWS:-256 1024}
bench=$tiller_root/.gpu/bench
for f in peer_bench.py decode_peer.py; do
  [ -f "$bench/$f" ] || { echo "bench_generate.sh: $bench/$f is missing; copy it from ../shared/bench" >&2; exit 2; }
done
tmp=$(mktemp -d)
for new in $news; do
for m in ${MODELS:-0.5b 7b}; do
  for b in ${BATCHES:-64 256}; do
    id=$m-$b-$new
    "$gpu_build/bin/tiller" bench generate --model "qwen2-$m" --batch "$b" --prompt-len "$prompt" --new-tokens "$new" \
      ${PROFILE_DIR:+--profile "$PROFILE_DIR/trace-$id.json"} ${GEN_ARGS:-} --out "$tmp/tiller-$id.json" > /dev/null
    $python "$bench/decode_peer.py" "$m" "$b" "$prompt" "$new" | grep '^{' | tail -1 > "$tmp/graph-$id.json"
    if [ "${HF:-1}" = 1 ]; then
      $python "$bench/peer_bench.py" gen "$m" "$b" "$prompt" "$new" | grep '^{' | tail -1 > "$tmp/hf-$id.json"
    fi
    cat "$tmp/tiller-$id.json" "$tmp/graph-$id.json"
  done
done
done
$python - "$tmp" "$out" "${MODELS:-0.5b 7b}" "${BATCHES:-64 256}" "$news" <<'PY'
import json, os, sys, datetime
tmp, out, models, batches, news = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split(), sys.argv[5].split()
rows = []
for new in news:
  for m in models:
    for b in batches:
        i = f"{m}-{b}-{new}"
        t = json.load(open(f"{tmp}/tiller-{i}.json"))
        g = json.loads(open(f"{tmp}/graph-{i}.json").read())
        # Both decode rates: tokens per second of decode steps (the peer's tokens_per_s has no prefill).
        row = {"model": f"qwen2-{m}", "batch": int(b), "new_tokens": int(new), "tiller": t, "cuda_graph_peer": g,
               "ratio_decode_tokens_per_s_vs_graph": round(t["decode_tokens_per_s"] / g["tokens_per_s"], 3),
               "ratio_step_vs_graph": round(g["step_ms"] / t["step_ms"], 3)}
        hf = f"{tmp}/hf-{i}.json"
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
