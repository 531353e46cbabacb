#!/usr/bin/env python3
"""The arithmetic example's model, tokenizer and data (examples/arithmetic/run.sh), deterministic:

  make_data.py OUT_DIR [--digits 4] [--train 200000] [--eval 1000] [--shape base|small|mini|tiny]

Task: add two numbers of up to --digits digits, with a worked answer that adds column by column,
right to left, carrying; the last line is "#### <sum>" (what reward.rule math_answer reads):
  prompt:   "Q: 4821+377="
  response: " 1+7=8 2+7=9 8+3=11 4+1=5 #### 5198"
OUT_DIR/model      a Qwen2-shaped causal LM from random weights (base: hidden 768, 12 layers, 12 heads,
                   4 KV heads, MLP 2048, tied embeddings: ~76M parameters; small: hidden 384, 6 layers,
                   6 heads, 2 KV heads, MLP 1024, ~9.5M: the distillation example's teacher; mini: hidden
                   256, 4 layers, MLP 688, ~3M: its student; tiny: 2
                   layers of 64, for the CPU smoke test), with a byte-level tokenizer (no merges: one token per
                   character, so the model adds digit by digit)
OUT_DIR/sft.jsonl  --train prompt/response pairs for tiller sft
OUT_DIR/rl.jsonl   the same prompts as {"input", "label"} for tiller train (GRPO)
OUT_DIR/eval.jsonl --eval held-out problems {"input", "label"} (never trained on)
"""
import argparse
import json
import random
from pathlib import Path


def problem(rng, digits):
    a = rng.randint(0, 10 ** rng.randint(1, digits) - 1)
    b = rng.randint(0, 10 ** rng.randint(1, digits) - 1)
    return a, b


def worked(a, b):
    """Column addition right to left: each column 'x+y=s' (with the carry added to x), then the sum."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        steps.append(f"{x + carry}+{y}={s}")
        carry = s // 10
    return " " + " ".join(steps) + f" #### {a + b}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--digits", type=int, default=4)
    ap.add_argument("--train", type=int, default=200000)
    ap.add_argument("--eval", type=int, default=1000)
    ap.add_argument("--shape", choices=["base", "small", "mini", "tiny"], default="base")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(2026)
    seen, train, held = set(), [], []
    while len(held) < args.eval:
        a, b = problem(rng, args.digits)
        if (a, b) not in seen:
            seen.add((a, b))
            held.append((a, b))
    while len(train) < args.train:
        a, b = problem(rng, args.digits)
        if (a, b) not in seen or len(seen) > 0.9 * 10 ** (2 * args.digits):
            seen.add((a, b))
            train.append((a, b))
    prompt = lambda a, b: f"Q: {a}+{b}="
    with open(out / "sft.jsonl", "w") as f:
        for a, b in train:
            f.write(json.dumps({"prompt": prompt(a, b), "response": worked(a, b)}) + "\n")
    with open(out / "rl.jsonl", "w") as f:
        for a, b in train:
            f.write(json.dumps({"input": prompt(a, b), "label": str(a + b)}) + "\n")
    with open(out / "eval.jsonl", "w") as f:
        for a, b in held:
            f.write(json.dumps({"input": prompt(a, b), "label": str(a + b)}) + "\n")

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # No merges: the 256 bytes and the special tokens, so every digit is its own token.
    trainer = trainers.BpeTrainer(vocab_size=256 + len(special), special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [prompt(a, b) + worked(a, b) for a, b in train[:20000]]
    tok.train_from_iterator(text, trainer)
    model_dir = out / "model"
    model_dir.mkdir(exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "model_max_length": 512}))
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    shape = {"base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          intermediate_size=2048),
             "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                           intermediate_size=1024),
             "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=688),
             "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=176)}[args.shape]
    eos = tok.token_to_id("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, rope_theta=10000.0, **shape)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"train": len(train), "eval": len(held), "vocab": tok.get_vocab_size(), "params": params,
                      "example": {"prompt": prompt(*train[0]), "response": worked(*train[0])}}))


if __name__ == "__main__":
    main()
