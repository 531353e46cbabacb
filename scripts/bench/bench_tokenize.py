#!/usr/bin/env python3
"""Tokenizer encoding throughput: `tiller bench tokenize` beside Hugging Face `tokenizers` in the
same run, on the same texts, with the ids compared. Prints one JSON line per text.

  bench_tokenize.py TILLER TOKENIZER_DIR [--mb 10] [--word-kb 100] [--work DIR]

Texts: `ordinary` (the repository's docs, repeated to --mb MB: prose, code, tables, newlines) and
`one_word` (a single --word-kb KB word of letters, no space: the worst case of a BPE merge loop).
Exit code 1 when the ids differ.
"""
import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[2]


def texts(mb, word_kb):
    docs = "".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))
    docs += (REPO / "README.md").read_text(encoding="utf-8")
    ordinary = (docs * (int(mb * 1e6) // len(docs.encode()) + 1))
    ordinary = ordinary.encode()[: int(mb * 1e6)].decode("utf-8", errors="ignore")
    rng = random.Random(0)
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(word_kb * 1000))
    return {"ordinary": ordinary, "one_word": word}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tiller")
    ap.add_argument("tokenizer")
    ap.add_argument("--mb", type=float, default=10)
    ap.add_argument("--word-kb", type=int, default=100)
    ap.add_argument("--work", default="/tmp/bench_tokenize")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    hf = Tokenizer.from_file(str(Path(a.tokenizer) / "tokenizer.json"))
    ok = True
    for name, text in texts(a.mb, a.word_kb).items():
        f = work / f"{name}.txt"
        f.write_text(text, encoding="utf-8")
        ids_file = work / f"{name}.ids"
        out = subprocess.run([a.tiller, "bench", "tokenize", "--tokenizer", a.tokenizer, "--file", str(f),
                              "--ids-out", str(ids_file)], check=True, capture_output=True, text=True).stdout
        mine = json.loads(out.strip().splitlines()[-1])
        t0 = time.perf_counter()
        ref = hf.encode(text, add_special_tokens=False).ids
        hf_s = time.perf_counter() - t0
        got = [int(x) for x in ids_file.read_text().split()]
        same = got == ref
        ok = ok and same
        print(json.dumps({"bench": "tokenize", "text": name, "bytes": mine["bytes"], "tokens": mine["tokens"],
                          "tiller_s": round(mine["seconds"], 3), "hf_tokenizers_s": round(hf_s, 3),
                          "ratio_hf_over_tiller": round(hf_s / mine["seconds"], 3), "same_ids": same}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
