#!/usr/bin/env python3
"""Makes what configs/quickstart.yaml needs, with transformers and tokenizers (CPU, seconds):

  make_quickstart.py [MODEL_DIR] [PROMPTS] [--moe | --mha] [--sharp]
                     (defaults: models/tiny-qwen2, data/quickstart/prompts.jsonl)

MODEL_DIR  a randomly initialised tiny Qwen2 (2 layers, hidden 64) with a byte-level BPE tokenizer
           of 320 tokens, saved as Hugging Face safetensors. The tokenizer is the file
           scripts/quickstart_tokenizer.json (trained once on this repository's docs of 2026-11-26):
           a fixed file, so that editing the docs no longer changes the model and every e2e curve.
           With --moe, a tiny Qwen3-MoE instead (4 experts of 64, top 2) with the same tokenizer.
           With --mha, 4 KV heads (one per query head) instead of 2: an engine can split them over
           4 tensor-parallel ranks (the hybrid TP-4 test).
PROMPTS    256 prompts for the toy task "toy_digits" (reward: the share of the response's
           characters that are digits), one JSON object per line; beside it eval.jsonl, 32 held-out
           prompts (data_source toy_digits) that eval.prompts evaluates.

Deterministic: the same files on every machine. Skips the work when MODEL_DIR/stamp holds this
script's hash.
"""
import hashlib
import json
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARGS = [a for a in sys.argv[1:] if a not in ("--moe", "--sharp", "--mha")]
MOE = "--moe" in sys.argv[1:]
MHA = "--mha" in sys.argv[1:]
# --sharp: weights drawn with a larger std (initializer_range 0.2), so the tied head's logits span
# a trained model's range. LoRA's tests use it: at transformers' 0.02 the final RMSNorm and the
# frozen head cap every logit near 1, and adapters alone cannot move the distribution far.
SHARP = "--sharp" in sys.argv[1:]
MODEL = Path(ARGS[0]) if len(ARGS) > 0 else REPO / "models" / "tiny-qwen2"
PROMPTS = Path(ARGS[1]) if len(ARGS) > 1 else REPO / "data" / "quickstart" / "prompts.jsonl"
TOKENIZER = Path(__file__).resolve().parent / "quickstart_tokenizer.json"
STAMP = hashlib.sha256(Path(__file__).read_bytes() + TOKENIZER.read_bytes()).hexdigest()


def prompts(seed=7, count=256, source=None):
    rng = random.Random(seed)
    words = ["count", "list", "write", "give", "say", "numbers", "digits", "please", "now", "some", "more", "then"]
    out = []
    for i in range(count):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        p = {"input": f"{text}:", "label": str(rng.randint(0, 999))}
        if source:
            p["data_source"] = source
        out.append(p)
    return out


def held_out(train):
    """32 evaluation prompts (eval.prompts) that are not among the training prompts."""
    seen = {p["input"] for p in train}
    return [p for p in prompts(seed=8, count=200, source="toy_digits") if p["input"] not in seen][:32]


def main():
    PROMPTS.parent.mkdir(parents=True, exist_ok=True)
    train = prompts()
    for path, rows in ((PROMPTS, train), (PROMPTS.parent / "eval.jsonl", held_out(train))):
        lines = "".join(json.dumps(p) + "\n" for p in rows)
        if not path.exists() or path.read_text() != lines:
            path.write_text(lines)
    stamp = STAMP + (" moe" if MOE else "") + (" sharp" if SHARP else "") + (" mha" if MHA else "")
    if (MODEL / "stamp").exists() and (MODEL / "stamp").read_text() == stamp:
        print(f"{MODEL} is current")
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from tokenizers import Tokenizer
    from transformers import (PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    tok = Tokenizer.from_file(str(TOKENIZER))
    MODEL.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(MODEL)

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4 if MHA else 2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.token_to_id("<|endoftext|>"),
                      bos_token_id=tok.token_to_id("<|endoftext|>"), torch_dtype="float32",
                      initializer_range=0.2 if SHARP else 0.02)
    model = Qwen2ForCausalLM(cfg).eval()
    if MOE:
        cfg = Qwen3MoeConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                             max_position_embeddings=512, tie_word_embeddings=True,
                             eos_token_id=tok.token_to_id("<|endoftext|>"),
                             bos_token_id=tok.token_to_id("<|endoftext|>"), torch_dtype="float32")
        model = Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(MODEL, safe_serialization=True)
    (MODEL / "stamp").write_text(stamp)
    print(f"wrote {MODEL} ({sum(p.numel() for p in model.parameters())} parameters) and {PROMPTS}")


if __name__ == "__main__":
    main()
