#!/usr/bin/env python3
"""The hidden rule's score of a PPO run's responses, step by step, from its rollout records
(logging.rollout_records with rollout_records_tokens): the share of each response's characters
that are digits (the rule that labelled the reward model's preference pairs; PPO saw only the
reward model). Prints one JSON line: the per-step means and the first and last three steps' mean.

  hidden_score.py RECORDS.jsonl TOKENIZER_DIR [--min-rise X]   (exit 1 if the score rose by less)
"""
import json
import sys
from collections import defaultdict
from pathlib import Path

from tokenizers import Tokenizer


def main():
    records, tok_dir = Path(sys.argv[1]), Path(sys.argv[2])
    min_rise = float(sys.argv[sys.argv.index("--min-rise") + 1]) if "--min-rise" in sys.argv else None
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    per_step = defaultdict(list)
    for line in records.read_text().splitlines():
        r = json.loads(line)
        if r.get("event") != "trained":
            continue
        text = tok.decode(r["response_ids"], skip_special_tokens=True)
        per_step[r["step"]].append(sum(c.isdigit() for c in text) / max(1, len(text)))
    steps = sorted(per_step)
    means = [sum(per_step[s]) / len(per_step[s]) for s in steps]
    first, last = sum(means[:3]) / 3, sum(means[-3:]) / 3
    print(json.dumps({"steps": len(steps), "hidden_score_first3": round(first, 4), "hidden_score_last3": round(last, 4),
                      "per_step": [round(m, 4) for m in means]}))
    if min_rise is not None and last - first < min_rise:
        print(f"hidden_score.py: the hidden rule's score rose by {last - first:.3f}, less than {min_rise}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
