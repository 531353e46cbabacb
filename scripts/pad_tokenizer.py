#!/usr/bin/env python3
"""Copies a byte-level BPE tokenizer (tokenizer.json + its configs) and pads its vocabulary with
unreachable tokens ("<pad_N>"-like ASCII strings, no merges lead to them) up to VOCAB entries, so
that every id a model of that vocabulary size can sample decodes. For timing runs with random
weights of a real model's shape (scripts/gpu/make_models.sh): encoding is unchanged.
  pad_tokenizer.py SRC_DIR DST_DIR VOCAB
"""
import json
import shutil
import sys
from pathlib import Path

src, dst, size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.name.startswith("tokenizer") or f.name.startswith("special_tokens") or f.name in ("vocab.json", "merges.txt"):
        shutil.copy(f, dst / f.name)
tok = json.loads((src / "tokenizer.json").read_text())
vocab = tok["model"]["vocab"]
taken = set(vocab.values()) | {a["id"] for a in tok.get("added_tokens", [])}
for i in range(size):
    if i not in taken:
        vocab[f"xpad{i}"] = i
(dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
print(f"{dst}: {len(vocab)} vocabulary entries (padded to {size})")
