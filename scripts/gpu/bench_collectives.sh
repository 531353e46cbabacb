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
# peer, tiller, peer: the peer runs on either side of tiller, so GPU clock or warm-up effects show
# as a difference between the two peer runs rather than as a tiller/peer gap.
run_peer() { torchrun --standalone --nproc-per-node "$n" "$peer" nccl | grep '^{' > "$1"; cat "$1"; }
run_peer "$tmp/peer_before.json"
mpirun -np "$n" --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
  -x NVSHMEM_DISABLE_NVLS "$gpu_build/bin/tiller" bench collectives --backend nccl --out "$tmp/tiller.json"
run_peer "$tmp/peer_after.json"
$python - "$tmp/tiller.json" "$tmp/peer_before.json" "$tmp/peer_after.json" "$out" <<'PY'
import json, sys, datetime
t = json.load(open(sys.argv[1]))
runs = [json.loads(open(f).read().strip().splitlines()[-1]) for f in sys.argv[2:4]]
# The peer's better run of the two for each measurement: the ratio is never flattered.
p = {k: max(r[k] for r in runs) if k.endswith("_busbw_GBps") else runs[0][k] for k in runs[0]}
keys = [k for k in p if k.endswith("_busbw_GBps")]
# Same definition as the peer (rank 0's time), and tiller's conservative one (slowest rank).
ratio = {k.replace("_busbw_GBps", "_ratio"): round(t[k.replace("_busbw", "_rank0_busbw")] / p[k], 3) for k in keys}
ratio_slowest = {k.replace("_busbw_GBps", "_ratio"): round(t[k] / p[k], 3) for k in keys}
res = {"bench": "collectives_vs_peer", "date": datetime.date.today().isoformat(), "world": t["world"],
       "ratio_tiller_over_peer": ratio, "ratio_slowest_rank_over_peer": ratio_slowest,
       "tiller": t, "peer_best_of_2": p, "peer_runs": runs}
text = json.dumps(res)
print(text)
if sys.argv[4]:
    open(sys.argv[4], "w").write(text + "\n")
PY
