#!/usr/bin/env bash
# On the GPU host, 4 GPUs: tiller bench sync (actor ZeRO-3 over 2 GPUs, engines on the other 2)
# beside ../shared/bench/peer_bench.py nccl (NCCL broadcast bus bandwidth over the same 4 GPUs,
# torch.distributed) in the same run, and the ratio of the sync's GB/s to the broadcast's.
# Copy peer_bench.py into .gpu/bench/ first (git-ignored; carry .gpu).
#   MODELS="qwen2-1.5b qwen2-7b" TPS="1 2" BUCKETS=32,64,128,256,512,1024 scripts/gpu/bench_sync.sh [OUT.json]
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
peer=$tiller_root/.gpu/bench/peer_bench.py
[ -f "$peer" ] || { echo "bench_sync.sh: $peer is missing; copy ../shared/bench/peer_bench.py there" >&2; exit 2; }
tmp=$(mktemp -d)
torchrun --standalone --nproc-per-node 4 "$peer" nccl | grep '^{' | tail -1 > "$tmp/peer.json"
cat "$tmp/peer.json"
for model in ${MODELS:-qwen2-1.5b qwen2-7b}; do
  for tp in ${TPS:-1 2}; do
    mpirun -np 4 --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
      -x NVSHMEM_DISABLE_NVLS "$gpu_build/bin/tiller" bench sync --model "$model" --actors 2 --engine-tp "$tp" \
      --bucket-mb "${BUCKETS:-32,64,128,256,512,1024}" --syncs "${SYNCS:-5}" --out "$tmp/tiller-$model-tp$tp.json"
  done
done
$python - "$tmp" "$out" "${MODELS:-qwen2-1.5b qwen2-7b}" "${TPS:-1 2}" <<'PY'
import json, sys, datetime
tmp, out, models, tps = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
peer = json.loads(open(f"{tmp}/peer.json").read())
bcast = peer["broadcast_1024MB_busbw_GBps"]
rows = []
for m in models:
    for tp in tps:
        t = json.load(open(f"{tmp}/tiller-{m}-tp{tp}.json"))
        for r in t["results"]:
            r["ratio_vs_broadcast"] = round(r["GBps"] / bcast, 3)
        rows.append({"model": m, "engine_tp": int(tp), "best_seconds": t["best"]["seconds"],
                     "best_GBps": t["best"]["GBps"], "best_bucket_mb": t["best"]["bucket_mb"],
                     "ratio_vs_broadcast": round(t["best"]["GBps"] / bcast, 3), "tiller": t})
res = {"bench": "sync_vs_nccl_broadcast", "date": datetime.date.today().isoformat(),
       "peer_broadcast_1024MB_busbw_GBps": bcast, "peer": peer, "results": rows}
text = json.dumps(res)
print(text)
if out:
    open(out, "w").write(text + "\n")
PY
