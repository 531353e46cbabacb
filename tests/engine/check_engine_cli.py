#!/usr/bin/env python3
"""`tiller engine` + `tiller generate --engine` end to end: the engine (TP 1, and TP 2 under
mpirun) gives the reference generator's output, greedy and seeded (a seeded sample may part from
the reference's at one sampling boundary within rounding, after a prefix with equal log-probs, in
at most one prompt; and it repeats exactly); SIGTERM stops it cleanly. `tiller engine --lora`
serves a PEFT adapter unmerged, at TP 1 and 2: PEFT's greedy ids.

  check_engine_cli.py TILLER_BINARY FIXTURES_DIR SCRATCH_DIR MPIRUN [MPIRUN_ARGS...]
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

tiller, fixtures, scratch, mpirun = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
scratch.mkdir(parents=True, exist_ok=True)
model = fixtures / "models" / "qwen2-chat"
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


ref = json.loads((fixtures / "models" / "reference.json").read_text())["qwen2-chat"]
prompts = scratch / "prompts.jsonl"
prompts.write_text("".join(json.dumps({"question": p}) + "\n" for p in ref["prompts"]), encoding="utf-8")


def generate(name, extra):
    out = scratch / f"{name}.jsonl"
    subprocess.run([tiller, "generate", "--model", str(model), "--prompts", str(prompts), "--input-key", "question",
                    "--chat-template", "auto", "--max-new-tokens", "12", "--out", str(out)] + extra,
                   check=True, timeout=300)
    # "\n" only: splitlines() also splits at U+0085 and U+2028, which JSON strings hold raw.
    return [json.loads(l) for l in out.read_text(encoding="utf-8").split("\n") if l]


def start_engine(launcher, tp, extra=()):
    proc = subprocess.Popen(launcher + [tiller, "engine", "--model", str(model), "--port", "0", "--host", "127.0.0.1",
                                        "--tp", str(tp), "--device", "cpu", "--num-blocks", "64", "--block-size", "8",
                                        *extra],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=60)
        raise SystemExit(f"tiller engine (tp {tp}) exited with {proc.returncode} before serving")
    info = json.loads(line)
    return proc, f"127.0.0.1:{info['port']}", info


def stop(proc, info, what):
    # To the serving rank itself (under mpirun, a signal to mpirun ends the whole job instead).
    os.kill(info["pid"], signal.SIGTERM)
    t0 = time.time()
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    check(code == 0, f"{what}: SIGTERM stops the engine with exit 0 (got {code}) in {time.time() - t0:.1f} s")


sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7"]
reference_greedy = generate("ref_greedy", ["--greedy"])
reference_sampled = generate("ref_sampled", sampled)
for tp, launcher in [(1, []), (2, mpirun + ["-np", "2"])]:
    proc, address, info = start_engine(launcher, tp)
    check(info["tp"] == tp and info["kv_blocks"] == 64, f"tp {tp}: engine serving ({info})")
    try:
        greedy = generate(f"engine{tp}_greedy", ["--greedy", "--engine", address])
        for i, row in enumerate(greedy):
            check(row["response_ids"] == ref["greedy"][i][:12] or row["response_ids"] == reference_greedy[i]["response_ids"],
                  f"tp {tp} prompt {i}: engine greedy ids equal HF's")
            check(row["response_ids"] == reference_greedy[i]["response_ids"], f"tp {tp} prompt {i}: greedy equals the reference")
            diffs = [abs(a - b) for a, b in zip(row["logprobs"], reference_greedy[i]["logprobs"])]
            worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else 0
            # Seen once in a loaded local run, not reproduced: the numbers say by how much and where.
            check(all(d < 1e-4 for d in diffs),
                  f"tp {tp} prompt {i}: greedy log-probs equal the reference's (largest difference "
                  f"{max(diffs, default=0):.3g} at token {worst}: {row['logprobs'][worst:worst + 1]} against "
                  f"{reference_greedy[i]['logprobs'][worst:worst + 1]})")
        seeded = generate(f"engine{tp}_sampled", sampled + ["--engine", address])
        again = generate(f"engine{tp}_sampled_again", sampled + ["--engine", address])
        diverged = 0
        for i, row in enumerate(seeded):
            check(row["response_ids"] == again[i]["response_ids"], f"tp {tp} prompt {i}: a seeded request is repeatable")
            ref_ids, ref_lp = reference_sampled[i]["response_ids"], reference_sampled[i]["logprobs"]
            k = next((j for j, (a, b) in enumerate(zip(row["response_ids"], ref_ids)) if a != b), None)
            if k is None:
                check(len(row["response_ids"]) == len(ref_ids), f"tp {tp} prompt {i}: seeded sample equals the reference's")
                continue
            # The same draws over logits that differ only by rounding (TP 2 sums partial products)
            # can still land on either side of a sampling boundary: the random fixture's
            # distributions are near-uniform (log-probs ~ -ln V), so its boundaries are ~1e-3 apart.
            # Accept a divergence only after a prefix whose log-probs agree.
            diverged += 1
            check(all(abs(a - b) < 1e-4 for a, b in zip(row["logprobs"][:k], ref_lp[:k])),
                  f"tp {tp} prompt {i}: seeded sample equals the reference's up to token {k}, with equal log-probs")
        check(diverged <= 1, f"tp {tp}: seeded samples diverge from the reference's in {diverged} of 3 prompts (at most 1)")
    finally:
        stop(proc, info, f"tp {tp}")

# A PEFT adapter served unmerged (fp32 beside the base; each TP rank its slice): PEFT's greedy ids.
lora_dir = fixtures / "models" / "qwen2-chat-lora"
lora_ref = json.loads((fixtures / "models" / "reference.json").read_text())["qwen2-chat-lora"]["greedy"]
for tp, launcher in [(1, []), (2, mpirun + ["-np", "2"])]:
    proc, address, info = start_engine(launcher, tp, ["--lora", str(lora_dir)])
    check(info["lora"] == str(lora_dir), f"lora tp {tp}: engine serving the adapter ({info})")
    try:
        greedy = generate(f"engine{tp}_lora", ["--greedy", "--engine", address])
        got = [row["response_ids"][:10] for row in greedy]
        check(got == [r[:10] for r in lora_ref] and got != [r[:10] for r in ref["greedy"]],
              f"lora tp {tp}: greedy ids {got} == PEFT's {lora_ref}")
    finally:
        stop(proc, info, f"lora tp {tp}")

# No engine at the address: a clear error, not a hang.
bad = subprocess.run([tiller, "generate", "--model", str(model), "--prompts", str(prompts), "--input-key", "question",
                      "--greedy", "--max-new-tokens", "2", "--engine", "127.0.0.1:1"],
                     capture_output=True, text=True, timeout=120)
check(bad.returncode != 0 and "127.0.0.1:1" in bad.stderr and "engine" in bad.stderr,
      f"no engine: exit {bad.returncode}, says: {bad.stderr.strip()}")
bad = subprocess.run([tiller, "engine", "--model", str(scratch / "missing"), "--port", "0"],
                     capture_output=True, text=True, timeout=120)
check(bad.returncode != 0 and "missing" in bad.stderr, f"missing model: exit {bad.returncode}, says: {bad.stderr.strip()}")
sys.exit(1 if failures else 0)
