"""FSDP2 peer of `tiller bench train --model qwen3-30b-a3b-8l`: transformers' Qwen3-MoE of tiller's
qwen3-30b-a3b-8l preset (Qwen3-30B-A3B's first 8 layers: 128 experts of 768, top 8, random
weights) under fsdp_accumulate_peer.py's FSDP2 recipe (activation checkpointing, each decoder
layer sharded, bf16 compute, fp32 reduce, fused AdamW), its experts run by transformers' grouped
GEMMs (`_experts_implementation = "grouped_mm"`, PEER_EXPERTS to choose another). Needs
../shared/bench/peer_bench.py copied into .gpu/bench/ (fsdp_accumulate_peer.py imports it).
  torchrun --standalone --nproc-per-node 2 scripts/gpu/moe_peer.py 2048 4 [steps]
Prints one JSON line, peer_bench.py's fields; the MFU counts the active parameters (a token's 8
experts), as tiller bench train does."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_accumulate_peer import fsdp2_setup  # noqa: E402
from peer_bench import log  # noqa: E402  (on the path fsdp_accumulate_peer.py set)


def qwen3_moe_8l():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6,
                          tie_word_embeddings=False, output_router_logits=False)


def main(seq, mbs, steps):
    from transformers import AutoModelForCausalLM

    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    cfg = qwen3_moe_8l()
    cfg._attn_implementation = "sdpa"
    experts = os.environ.get("PEER_EXPERTS", "grouped_mm")
    cfg._experts_implementation = experts
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt, nparam = fsdp2_setup(model)
    h, i, e, k, layers = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    active = nparam - (e - k) * 3 * h * i * layers
    emb = cfg.vocab_size * h
    times = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (mbs, seq), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    timed = sorted(times[2:])
    dt = timed[len(timed) // 2]
    tok_s_gpu = mbs * seq / dt
    flops_tok = 6 * (active - emb) + 6 * layers * h * seq
    log(json.dumps({"bench": "fsdp2", "model": "qwen3-30b-a3b-8l", "experts_implementation": experts,
                    "params_B": round(nparam / 1e9, 3), "active_params_B": round(active / 1e9, 3),
                    "world": dist.get_world_size(), "seq": seq, "mbs": mbs, "step_s": round(dt, 3),
                    "tokens_per_s_per_gpu": round(tok_s_gpu), "mfu_vs_989": round(flops_tok * tok_s_gpu / 989e12, 3),
                    "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    steps = int(a[2]) if len(a) > 2 else 6
    if len(a) < 2 or steps < 3:
        sys.exit("moe_peer.py SEQ MBS [STEPS] (at least 3 steps: two are warm-up)")
    main(int(a[0]), int(a[1]), steps)
