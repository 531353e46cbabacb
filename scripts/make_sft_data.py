#!/usr/bin/env python3
"""Writes the toy task's supervised data (configs/sft_quickstart.yaml), deterministic:

  make_sft_data.py [OUT_DIR]   (default: data/sft)

OUT_DIR/toy.jsonl       400 prompt/response pairs: the quickstart's prompts (scripts/make_quickstart.py
                        words) answered with the digits the toy task rewards ("74 74 74").
OUT_DIR/toy_chat.jsonl  the same as conversations under "messages": a system turn, then one or two
                        user/assistant exchanges (multi-turn: every assistant turn is trained).
OUT_DIR/toy_pairs.jsonl 600 preference pairs (prompt, chosen, rejected): two responses mixing digits
                        and words, labelled by a rule the RL run never sees (the response whose
                        characters are more often digits is chosen: the toy task's toy_digits score).
"""
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "data" / "sft"
WORDS = ["count", "list", "write", "give", "say", "numbers", "digits", "please", "now", "some", "more", "then"]


def digit_share(text):
    return sum(c.isdigit() for c in text) / max(1, len(text))


def mixed(rng):
    """A response of 2-5 items, each a number or a word."""
    return " ".join(str(rng.randint(0, 99)) if rng.random() < rng.random() else rng.choice(WORDS)
                    for _ in range(rng.randint(2, 5)))


def main():
    rng = random.Random(11)
    pairs, chats = [], []
    for _ in range(400):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) + ":"
        n = rng.randint(0, 99)
        response = " ".join([str(n)] * rng.randint(2, 4))
        pairs.append({"prompt": prompt, "response": response})
        messages = [{"role": "system", "content": "answer with digits"},
                    {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        if rng.random() < 0.5:
            messages += [{"role": "user", "content": "again:"}, {"role": "assistant", "content": str(n)}]
        chats.append({"messages": messages})
    prefs = []
    for _ in range(600):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) + ":"
        a, b = mixed(rng), mixed(rng)
        while digit_share(a) == digit_share(b):
            b = mixed(rng)
        chosen, rejected = (a, b) if digit_share(a) > digit_share(b) else (b, a)
        prefs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "toy_pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prefs))
    (OUT / "toy.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (OUT / "toy_chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    print(f"wrote {OUT}/toy.jsonl and toy_chat.jsonl (400 records each), toy_pairs.jsonl (600 pairs)")


if __name__ == "__main__":
    main()
