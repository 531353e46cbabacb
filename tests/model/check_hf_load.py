#!/usr/bin/env python3
"""Loads the checkpoints tiller wrote (tests/model/model_test.cpp, HfWrite.CheckpointsForTransformers)
with transformers and checks that they give the logits stored beside them.

  check_hf_load.py DIR      (DIR/manifest.json lists the models and the inputs)
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

root = Path(sys.argv[1])
manifest = json.loads((root / "manifest.json").read_text())
failed = False
for name in manifest["models"]:
    model = AutoModelForCausalLM.from_pretrained(str(root / name), dtype=torch.float32).eval()
    ref = load_file(str(root / name / "reference_logits.safetensors"))
    with torch.no_grad():
        for i, ids in enumerate(manifest["inputs"]):
            got = model(torch.tensor([ids])).logits[0]
            diff = (got - ref[f"logits_{i}"]).abs().max().item()
            ok = diff < 2e-4
            failed |= not ok
            print(f"{name} input {i}: max |transformers - tiller| = {diff:.2e} {'ok' if ok else 'FAIL'}")
sys.exit(1 if failed else 0)
