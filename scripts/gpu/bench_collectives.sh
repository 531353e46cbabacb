#!/usr/bin/env bash
# On the GPU host, N GPUs (default: all): tiller bench collectives beside
# ../shared/bench/peer_bench.py nccl (torch.distributed over the same NCCL), in the same run,
# and the ratio tiller / peer of each bus bandwidth. Copy peer_bench.py into .gpu/bench/ first
# (git-ignored; carry .gpu). Writes JSON to $1 (default: stdout only).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${1:-}
n=${NGPU:-$(nvidia-smi -L | wc -l)}
peer=$tiller_root/.gpu/bench/peer_bench.py
[ -f "$peer" ] || { echo "bench_collectives.sh: $peer is missing; copy ../shared/bench/peer_bench.py there" >&2; exit 2; }
tmp=$(mktemp -d)
mpirun -np "$n" --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
  -x NVSHMEM_DISABLE_NVLS "$gpu_build/bin/tiller" bench collectives --backend nccl --out "$tmp/tiller.json"
torchrun --standalone --nproc-per-node "$n" "$peer" nccl | grep '^{' > "$tmp/peer.json"
cat "$tmp/peer.json"
$python - "$tmp/tiller.json" "$tmp/peer.json" "$out" <<'PY'
import json, sys, datetime
t = json.load(open(sys.argv[1])); p = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
ratio = {k.replace("_busbw_GBps", "_ratio"): round(t[k] / p[k], 3) for k in p if k.endswith("_busbw_GBps") and k in t}
res = {"bench": "collectives_vs_peer", "date": datetime.date.today().isoformat(), "world": t["world"],
       "tiller": t, "peer": p, "ratio_tiller_over_peer": ratio}
text = json.dumps(res)
print(text)
if sys.argv[3]:
    open(sys.argv[3], "w").write(text + "\n")
PY
