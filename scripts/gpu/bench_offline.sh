#!/usr/bin/env bash
# On the GPU host, N GPUs (default 2): tiller sft and tiller train-rm beside their FSDP2 peers
# (scripts/gpu/offline_peer.py) on the same shape and tokens per GPU per step, in the same run, and
# the ratio of tokens/s/GPU. Random weights (scripts/gpu/make_models.sh) and random text cut to
# fixed lengths: SFT samples of 2048 tokens (a 512-token prompt, the loss on the rest), 4 per GPU per
# step; reward-model pairs whose sides have 1024 tokens (512 of them the shared prompt), 4 pairs per
# GPU per step. Copy ../shared/bench/peer_bench.py into .gpu/bench/ first (git-ignored; carry .gpu).
#   NGPU=2 SIZE=1.5b STEPS=10 scripts/gpu/bench_offline.sh [OUT.json]
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$tiller_root"
out=${1:-}
n=${NGPU:-2}
size=${SIZE:-1.5b}
steps=${STEPS:-10}
seq=2048 prompt=512 mbs=4 side=1024
[ -f .gpu/bench/peer_bench.py ] || { echo "bench_offline.sh: .gpu/bench/peer_bench.py is missing; copy ../shared/bench/peer_bench.py there" >&2; exit 2; }
[ "$steps" -ge 4 ] || { echo "bench_offline.sh: STEPS=$steps: at least 4 (the first two are warm-up)" >&2; exit 2; }
bash scripts/gpu/make_models.sh "$size"
model=models/qwen2.5-$size
tmp=$(mktemp -d)
# Records whose prompt is $prompt tokens and whose answers run past the length cap (offline.long_samples
# truncate cuts every sample, or every pair's side, to exactly offline.max_tokens).
$python - "$model/tokenizer.json" "$tmp" $((steps * n * mbs)) "$prompt" <<'PY'
import json, random, sys
from tokenizers import Tokenizer
tok, tmp, count, prompt = Tokenizer.from_file(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
words = ["the", "model", "answer", "step", "token", "reward", "policy", "value", "train", "sample", "of", "a",
         "is", "and", "to", "in", "gradient", "batch", "engine", "weight", "number", "sum", "chain", "proof"]
def text(n_tokens):  # random words cut at n_tokens tokens
    ids = tok.encode(" ".join(rng.choice(words) for _ in range(2 * n_tokens))).ids[:n_tokens]
    return tok.decode(ids)
with open(f"{tmp}/sft.jsonl", "w") as f:
    for _ in range(count):
        f.write(json.dumps({"prompt": text(prompt), "response": text(2048)}) + "\n")
with open(f"{tmp}/pairs.jsonl", "w") as f:
    for _ in range(count):
        f.write(json.dumps({"prompt": text(prompt), "chosen": text(1024), "rejected": text(1024)}) + "\n")
PY
mpi=(mpirun -np "$n" --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
     -x NVSHMEM_DISABLE_NVLS)
common=(--set cluster.device=cuda --set cluster.backend=nccl --set roles.actor.gpus="$n" --set roles.actor.dtype=bf16
        --set roles.actor.model="$model" --set offline.eval_samples=0 --set offline.epochs=1
        --set offline.max_steps="$steps" --set offline.long_samples=truncate --set train.train_batch_size=$((n * mbs))
        --set train.actor_lr=1.0e-5 --set train.warmup_steps=0 --set checkpoint.dir=)
"${mpi[@]}" "$gpu_build/bin/tiller" sft -c configs/sft_quickstart.yaml "${common[@]}" --set run.output_dir="$tmp/sft" \
  --set offline.data="$tmp/sft.jsonl" --set offline.max_tokens=$seq --set train.micro_batch_tokens=$((mbs * seq)) \
  > "$tmp/sft.log" 2>&1 || { tail -20 "$tmp/sft.log"; exit 1; }
torchrun --standalone --nproc-per-node "$n" scripts/gpu/offline_peer.py sft "$size" $seq $mbs $prompt "$steps" |
  grep '^{' | tail -1 > "$tmp/peer-sft.json"
"${mpi[@]}" "$gpu_build/bin/tiller" train-rm -c configs/rm_quickstart.yaml "${common[@]}" --set run.output_dir="$tmp/rm" \
  --set offline.data="$tmp/pairs.jsonl" --set offline.max_tokens=$side --set train.micro_batch_tokens=$((mbs * 2 * side)) \
  > "$tmp/rm.log" 2>&1 || { tail -20 "$tmp/rm.log"; exit 1; }
torchrun --standalone --nproc-per-node "$n" scripts/gpu/offline_peer.py rm "$size" $side $mbs "$steps" |
  grep '^{' | tail -1 > "$tmp/peer-rm.json"
$python - "$tmp" "$out" "$size" "$n" <<'PY'
import datetime, json, statistics, subprocess, sys
tmp, out, size, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
rows = []
for job in ("sft", "rm"):
    steps = [json.loads(l) for l in open(f"{tmp}/{job}/metrics.jsonl")]
    steps = [s for s in steps if "throughput/tokens_per_s_per_gpu" in s][2:]  # the first two are warm-up
    t = {"tokens_per_s_per_gpu": round(statistics.median(s["throughput/tokens_per_s_per_gpu"] for s in steps)),
         "step_s": round(statistics.median(s["time/step"] for s in steps), 3),
         "tokens_per_step": round(statistics.median(s["train/tokens"] for s in steps)),
         "last_loss": round(steps[-1]["train/loss"], 4)}
    p = json.loads(open(f"{tmp}/peer-{job}.json").read())
    rows.append({"job": job, "ratio_tokens_per_s": round(t["tokens_per_s_per_gpu"] / p["tokens_per_s_per_gpu"], 3),
                 "tiller": t, "fsdp2": p})
res = {"bench": "offline_vs_fsdp2", "date": datetime.date.today().isoformat(), "gpu": gpu.strip().splitlines()[0],
       "gpus": n, "model": f"qwen2-{size}", "results": rows}
text = json.dumps(res)
print(text)
if out:
    open(out, "w").write(text + "\n")
PY
