#!/usr/bin/env python3
"""Arithmetic word problems for the calculator environment (env_server.py --env calculator), as a
JSONL prompt file: {"input": problem with the tool's instructions, "label": the answer}.

    python3 examples/envs/make_calculator_prompts.py data/calculator/prompts.jsonl 2000
"""
import json
import os
import random
import sys

INSTRUCTIONS = ("You may use a calculator: write <calc>expression</calc> and the result comes back as "
                "<result>value</result>. Give the final number as <answer>number</answer>.")

TEMPLATES = [
    ("A warehouse has {a} crates with {b} bottles in each. {c} bottles break. How many bottles are left?",
     lambda a, b, c: a * b - c),
    ("A train travels {a} km per hour for {b} hours, then {c} km more. How far does it go in all?",
     lambda a, b, c: a * b + c),
    ("{a} students share {b} pencils each and a teacher adds {c} more pencils. How many pencils are there?",
     lambda a, b, c: a * b + c),
    ("A baker makes {a} loaves a day for {b} days and sells all but {c}. How many loaves does the baker sell?",
     lambda a, b, c: a * b - c),
    ("A field is {a} m by {b} m; a path takes {c} square metres. How many square metres are left?",
     lambda a, b, c: a * b - c),
]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, count = sys.argv[1], int(sys.argv[2])
    rng = random.Random(7)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        for _ in range(count):
            text, answer = rng.choice(TEMPLATES)
            a, b = rng.randint(12, 99), rng.randint(12, 99)
            c = rng.randint(1, a * b - 1)
            f.write(json.dumps({"input": text.format(a=a, b=b, c=c) + " " + INSTRUCTIONS,
                                "label": str(answer(a, b, c))}) + "\n")
    print(f"{count} problems in {out}")


if __name__ == "__main__":
    main()
