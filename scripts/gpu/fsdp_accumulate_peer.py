"""FSDP2 peer of `tiller bench train --accumulate N`: ../shared/bench/peer_bench.py's fsdp job
(HF Qwen2 shape, random weights, activation checkpointing, bf16 compute, fp32 reduce, fused
AdamW) with N micro-batches per optimizer step, as a training job whose batch is larger than one
micro-batch runs it: each micro-batch's backward reduce-scatters its gradients into the sharded
ones (FSDP2's default), then one clip and one AdamW step. Reads the shapes from peer_bench.py
(copy it into .gpu/bench/, as scripts/gpu/bench_memory.sh does).
  torchrun --standalone --nproc-per-node 2 scripts/gpu/fsdp_accumulate_peer.py 7b 2048 4 16 [steps]
Prints one JSON line, peer_bench.py's fields plus "accumulate"; tokens per step count every
micro-batch."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".gpu", "bench"))
from peer_bench import log, qwen_cfg  # noqa: E402


def fsdp2_setup(model):
    """peer_bench.py's FSDP2 recipe on an HF model: activation checkpointing, each decoder layer
    and then the whole model sharded with bf16 compute and fp32 reduce, fused AdamW. Returns the
    optimizer and the parameter count."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    nparam = sum(p.full_tensor().numel() if hasattr(p, "full_tensor") else p.numel() for p in model.parameters())
    return opt, nparam


def init_rank(size):
    """The NCCL process group, this rank's GPU, seed 0, and peer_bench.py's config of `size` (SDPA).
    Returns the world size and the config."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    cfg = qwen_cfg(size)
    cfg._attn_implementation = "sdpa"
    return dist.get_world_size(), cfg


def main(size, seq, mbs, accumulate, steps):
    from transformers import AutoModelForCausalLM

    world, cfg = init_rank(size)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt, nparam = fsdp2_setup(model)
    emb = cfg.vocab_size * cfg.hidden_size
    times = []
    for _ in range(steps):
        batches = [torch.randint(0, cfg.vocab_size, (mbs, seq), device="cuda") for _ in range(accumulate)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for ids in batches:
            (model(input_ids=ids, labels=ids).loss / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    timed = sorted(times[2:])
    dt = timed[len(timed) // 2]
    tok_s_gpu = accumulate * mbs * seq / dt
    layers, d = cfg.num_hidden_layers, cfg.hidden_size
    flops_tok = 6 * (nparam - (0 if cfg.tie_word_embeddings else emb)) + 6 * layers * d * seq
    log(json.dumps({"bench": "fsdp2", "model": f"qwen2-{size}", "params_B": round(nparam / 1e9, 3), "world": world,
                    "seq": seq, "mbs": mbs, "accumulate": accumulate, "step_s": round(dt, 3),
                    "tokens_per_s_per_gpu": round(tok_s_gpu), "mfu_vs_989": round(flops_tok * tok_s_gpu / 989e12, 3),
                    "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    steps = int(a[4]) if len(a) > 4 else 4
    if steps < 3 or int(a[3]) < 1:
        sys.exit(f"fsdp_accumulate_peer.py: steps {steps} (at least 3: two are warm-up) and accumulate {a[3]} (at least 1)")
    main(a[0], int(a[1]), int(a[2]), int(a[3]), steps)
