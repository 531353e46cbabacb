#!/usr/bin/env python3
"""Greedy accuracy of a model on held-out problems (examples/arithmetic/run.sh): the share whose
answer after "####" equals the label. transformers' batched generate, on the GPU when there is one.

  eval.py MODEL_DIR EVAL.jsonl [--max-new-tokens 64] [--batch 250]    prints {"accuracy": ..., ...}
"""
import argparse
import json
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def answer(text):
    m = re.findall(r"####\s*(-?\d+)", text)
    return m[-1] if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("eval")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=250)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(args.model) / "tokenizer.json"), eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    model = model.to(dev).eval()
    rows = [json.loads(l) for l in Path(args.eval).read_text().splitlines()]
    right, examples = 0, []
    for i in range(0, len(rows), args.batch):
        chunk = rows[i:i + args.batch]
        enc = tok([r["input"] for r in chunk], return_tensors="pt", padding=True).to(dev)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for r, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
            text = tok.decode(ids, skip_special_tokens=True)
            right += answer(text) == r["label"]
            if len(examples) < 3:
                examples.append({"prompt": r["input"], "response": text})
    print(json.dumps({"accuracy": right / len(rows), "problems": len(rows), "examples": examples}))


if __name__ == "__main__":
    main()
