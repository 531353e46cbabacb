#!/usr/bin/env python3
"""Writes a prompt file of very long prompts for the long-sample runs (issue 59): N records of
arithmetic lines ending in a question, each at least TOKENS tokens of the quickstart's tokenizer
(about 1.07 characters a token: the BPE of scripts/make_quickstart.py), with the answer as label
(reward.rule math_answer). A run takes them with data.long_prompt_policy=truncate_left and
rollout.max_prompt_tokens at the length it wants, so that a sample of 128k tokens is mostly its
prompt and the engines prefill rather than decode it (random weights seldom end a response).

    scripts/gpu/make_long_prompts.py OUT.jsonl N TOKENS
"""
import json
import random
import sys


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit("usage: make_long_prompts.py OUT.jsonl N TOKENS")
    out, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if not 1 <= n <= 10_000 or not 1 <= tokens <= 10_000_000:
        sys.exit("make_long_prompts.py: N must be 1..10000 and TOKENS 1..10000000")
    rng = random.Random(59)
    with open(out, "w") as f:
        for i in range(n):
            parts, chars = [], 0
            # 1.5 characters a token: the tokenizer's 1.07 with room, so truncate_left always has
            # TOKENS to keep.
            while chars < tokens * 1.5:
                a, b = rng.randint(1, 999), rng.randint(1, 999)
                line = f"{a} + {b} = {a + b}. "
                parts.append(line)
                chars += len(line)
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            parts.append(f"{a} + {b} = ")
            f.write(json.dumps({"input": "".join(parts), "label": str(a + b)}) + "\n")


if __name__ == "__main__":
    main()
