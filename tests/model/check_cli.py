#!/usr/bin/env python3
"""`tiller tokenize`, `tiller generate` (with and without a PEFT LoRA adapter) and `tiller merge-lora`
end to end against the Hugging Face and PEFT references.

  check_cli.py TILLER_BINARY FIXTURES_DIR SCRATCH_DIR
"""
import json
import subprocess
import sys
from pathlib import Path

tiller, fixtures, scratch = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
scratch.mkdir(parents=True, exist_ok=True)
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


# tokenize: ids equal the tokenizers library's for every corpus text of every file.
tok_ref = json.loads((fixtures / "tokenizers" / "reference.json").read_text(encoding="utf-8"))
for name in ["gpt2", "qwen2", "llama3"]:
    for i, case in enumerate(tok_ref[name]["cases"]):
        f = scratch / "text.txt"
        f.write_bytes(case["text"].encode("utf-8"))
        out = subprocess.run([tiller, "tokenize", "--tokenizer", str(fixtures / "tokenizers" / name), "--file", str(f)],
                             capture_output=True, check=True)
        got = json.loads(out.stdout)["ids"]
        if got != case["ids"]:
            check(False, f"tokenize {name} case {i}: {got} != {case['ids']}")
check(not failures, "tokenize: every corpus text of gpt2, qwen2, llama3")

# generate: chat template, tokenization, greedy decoding, eos handling and decoding.
ref = json.loads((fixtures / "models" / "reference.json").read_text())["qwen2-chat"]
prompts = scratch / "prompts.jsonl"
prompts.write_text("".join(json.dumps({"question": p}) + "\n" for p in ref["prompts"]), encoding="utf-8")
out_file = scratch / "out.jsonl"
subprocess.run([tiller, "generate", "--model", str(fixtures / "models" / "qwen2-chat"), "--prompts", str(prompts),
                "--input-key", "question", "--chat-template", "auto", "--greedy", "--max-new-tokens", "10",
                "--batch-size", "2", "--out", str(out_file)], check=True)
rows = [json.loads(l) for l in out_file.read_text(encoding="utf-8").split("\n") if l]
check(len(rows) == len(ref["prompts"]), f"generate wrote {len(rows)} rows")
for i, row in enumerate(rows):
    check(row["prompt_ids"] == ref["prompt_ids"][i], f"prompt {i}: chat template + tokenizer give HF's prompt ids")
    check(row["response_ids"] == ref["greedy"][i], f"prompt {i}: greedy ids {row['response_ids']} == HF {ref['greedy'][i]}")
    check(row["response"] == ref["responses"][i], f"prompt {i}: response text equals HF's decode")
    check(len(row["logprobs"]) == len(row["response_ids"]) and all(lp <= 0 for lp in row["logprobs"]),
          f"prompt {i}: one log-prob <= 0 per token")
    stopped = bool(row["response_ids"]) and row["response_ids"][-1] == ref["greedy"][i][-1] and len(ref["greedy"][i]) < 10
    check(row["finish_reason"] == ("stop" if stopped else "length"), f"prompt {i}: finish_reason {row['finish_reason']}")

# LoRA: generate --lora runs PEFT's adapter unmerged and gives PEFT's greedy ids; merge-lora writes
# PEFT's merge_and_unload weight for weight, and the merged model generates the same ids.
lora_ref = json.loads((fixtures / "models" / "reference.json").read_text())["qwen2-chat-lora"]["greedy"]
base_args = ["--prompts", str(prompts), "--input-key", "question", "--chat-template", "auto", "--greedy",
             "--max-new-tokens", "10"]
lora_out = scratch / "lora.jsonl"
subprocess.run([tiller, "generate", "--model", str(fixtures / "models" / "qwen2-chat"), "--lora",
                str(fixtures / "models" / "qwen2-chat-lora"), *base_args, "--out", str(lora_out)], check=True)
got = [json.loads(l)["response_ids"] for l in lora_out.read_text().splitlines()]
check(got == lora_ref and got != ref["greedy"], f"generate --lora: greedy ids {got} == PEFT's {lora_ref}")
merged = scratch / "merged"
for name in ["llama", "qwen2-chat"]:
    p = subprocess.run([tiller, "merge-lora", "--model", str(fixtures / "models" / name), "--lora",
                        str(fixtures / "models" / f"{name}-lora"), "--to", str(merged / name)], capture_output=True, text=True)
    check(p.returncode == 0, f"merge-lora {name}: exit {p.returncode} {p.stderr[-500:]}")
from safetensors import safe_open  # noqa: E402
with safe_open(str(merged / "llama" / "model.safetensors"), "pt") as got_f, \
        safe_open(str(fixtures / "models" / "llama-lora-merged" / "model.safetensors"), "pt") as want_f:
    worst = max(float((got_f.get_tensor(k) - want_f.get_tensor(k)).abs().max()) for k in want_f.keys())
    check(set(got_f.keys()) == set(want_f.keys()) and worst <= 1e-6,
          f"merge-lora llama: every weight equals PEFT's merge_and_unload (max diff {worst:.2g})")
merged_out = scratch / "merged.jsonl"
subprocess.run([tiller, "generate", "--model", str(merged / "qwen2-chat"), *base_args, "--out", str(merged_out)],
               check=True)
got = [json.loads(l)["response_ids"] for l in merged_out.read_text().splitlines()]
check(got == lora_ref, f"generate on the merged chat model: greedy ids {got} == PEFT's")
half = scratch / "half_adapter"  # adapter_config.json without its weights
half.mkdir(parents=True, exist_ok=True)
(half / "adapter_config.json").write_bytes((fixtures / "models" / "llama-lora" / "adapter_config.json").read_bytes())
p = subprocess.run([tiller, "merge-lora", "--model", str(fixtures / "models" / "llama"), "--lora", str(half), "--to",
                    str(merged / "bad")], capture_output=True, text=True)
check(p.returncode != 0 and "adapter_model.safetensors" in p.stderr and p.stderr.count("\n") == 1,
      f"merge-lora with an adapter missing its weights: one line naming the file ({p.stderr.strip()[:300]})")
sys.exit(1 if failures else 0)
