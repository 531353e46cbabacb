"""FSDP2 peers of `tiller sft` and `tiller train-rm` (scripts/gpu/bench_offline.sh): what a user
of a PyTorch trainer runs instead: ../shared/bench/peer_bench.py's FSDP2 setup (HF Qwen2 shape,
random weights, activation checkpointing, bf16 compute, fp32 reduce, fused AdamW, one micro-batch
per optimizer step) with the SFT loss or a reward model's. Reads the shapes from peer_bench.py
(copy it into .gpu/bench/, as scripts/gpu/bench_train.sh does).
  torchrun --standalone --nproc-per-node 2 scripts/gpu/offline_peer.py sft 1.5b SEQ MBS PROMPT [steps]
      Qwen2ForCausalLM, MBS rows of SEQ tokens, the first PROMPT tokens of each row labelled -100
  torchrun --standalone --nproc-per-node 2 scripts/gpu/offline_peer.py rm 1.5b SEQ PAIRS [steps]
      Qwen2ForSequenceClassification (one label: the reward at the last token), PAIRS chosen rows
      and PAIRS rejected rows of SEQ tokens, the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected)
Prints one JSON line; tokens/s count every token of every row (as tiller's throughput does)."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".gpu", "bench"))
from peer_bench import log  # noqa: E402
from fsdp_accumulate_peer import fsdp2_setup, init_rank  # noqa: E402  (this script's folder)


def main(job, size, seq, rows, prompt, steps):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    world, cfg = init_rank(size)
    cfg.pad_token_id = cfg.vocab_size - 1  # never drawn below: the reward is read at the last token
    if job == "rm":
        cfg.num_labels = 1
    with torch.device("cuda"):
        model = (AutoModelForSequenceClassification if job == "rm" else AutoModelForCausalLM).from_config(
            cfg, dtype=torch.float32)
    opt, nparam = fsdp2_setup(model)
    n_rows = 2 * rows if job == "rm" else rows
    times, losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size - 1, (n_rows, seq), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        if job == "sft":
            labels = ids.clone()
            labels[:, :prompt] = -100
            loss = model(input_ids=ids, labels=labels).loss
        else:
            r = model(input_ids=ids).logits.float().squeeze(-1)
            loss = -F.logsigmoid(r[:rows] - r[rows:]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    timed = sorted(times[2:])
    dt = timed[len(timed) // 2]
    tok_s_gpu = n_rows * seq / dt
    log(json.dumps({"bench": f"fsdp2_{job}", "model": f"qwen2-{size}", "params_B": round(nparam / 1e9, 3),
                    "world": world, "seq": seq, "rows_per_gpu": n_rows, "step_s": round(dt, 3),
                    "tokens_per_s_per_gpu": round(tok_s_gpu), "last_loss": round(losses[-1], 4),
                    "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) < 4 or a[0] not in ("sft", "rm") or (a[0] == "sft" and len(a) < 5):
        sys.exit(__doc__)
    job = a[0]
    prompt = int(a[4]) if job == "sft" else 0
    rest = a[5:] if job == "sft" else a[4:]
    steps = int(rest[0]) if rest else 8
    if steps < 3:
        sys.exit(f"offline_peer.py: steps {steps}: at least 3 (two are warm-up)")
    main(job, a[1], int(a[2]), int(a[3]), prompt, steps)
