#!/usr/bin/env python3
"""The OpenAI endpoint's throughput against the gRPC path on one engine (issue 60: >= 0.9 of it).

One `tiller engine --openai-port` serves both. The gRPC path is `tiller generate --engine` with
every prompt in flight at once (its own tokens/s line: from the first request to the last
answer); the HTTP path is the same prompts as concurrent `/v1/completions` requests from a thread
each (timed the same way), with the same lengths (ignore_eos, the same max_tokens), sampled at
temperature 1 with seeds. Rounds alternate the two; the best round of each is reported.

  bench_openai.py TILLER MODEL [--device cuda:0] [--batch 64] [--prompt-len 128] [--max-tokens 256]
                  [--rounds 3] [--stream] [--out FILE.json]
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("tiller")
ap.add_argument("model")
ap.add_argument("--device", default="cuda:0")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--prompt-len", type=int, default=128)
ap.add_argument("--max-tokens", type=int, default=256)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--stream", action="store_true", help="the HTTP requests stream (server-sent events, a chunk per token)")
ap.add_argument("--out")
ap.add_argument("--engine-args", default="", help="extra `tiller engine` arguments, one string")
args = ap.parse_args()

tmp = Path(tempfile.mkdtemp(prefix="bench_openai_"))
rng = random.Random(1)
words = "the of and a to in is you that it he was for on are as with his they at be this have from".split()
prompts = [" ".join(rng.choice(words) for _ in range(args.prompt_len)) for _ in range(args.batch)]
(tmp / "prompts.jsonl").write_text("".join(json.dumps({"input": p}) + "\n" for p in prompts))

engine = subprocess.Popen([args.tiller, "engine", "--model", args.model, "--port", "0", "--openai-port", "0",
                           "--device", args.device, "--max-num-seqs", str(max(args.batch, 8)),
                           *args.engine_args.split()], stdout=subprocess.PIPE, text=True)
info = json.loads(engine.stdout.readline())
base = f"http://127.0.0.1:{info['openai_port']}"


def grpc_round(tokens):
    p = subprocess.run([args.tiller, "generate", "--model", args.model, "--prompts", str(tmp / "prompts.jsonl"),
                        "--engine", f"127.0.0.1:{info['port']}", "--max-new-tokens", str(tokens), "--ignore-eos",
                        "--batch-size", str(args.batch), "--seed", "1", "--out", str(tmp / "grpc.jsonl")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    if p.returncode != 0:
        sys.exit(f"bench_openai.py: tiller generate exited {p.returncode}:\n{p.stdout[-3000:]}")
    m = re.search(r"(\d+) tokens in ([0-9.]+) s", p.stdout)
    return int(m.group(1)) / max(float(m.group(2)), 1e-9)


def one(i, tokens):
    body = {"prompt": prompts[i], "max_tokens": tokens, "temperature": 1.0, "seed": i + 1, "ignore_eos": True,
            "stream": args.stream}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        data = r.read().decode()
    if args.stream:
        return sum(1 for line in data.split("\n") if line.startswith("data: {"))
    return json.loads(data)["usage"]["completion_tokens"]


def http_round(tokens):
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.batch) as pool:
        t0 = time.perf_counter()
        got = list(pool.map(lambda i: one(i, tokens), range(args.batch)))
        dt = time.perf_counter() - t0
    if not args.stream:
        assert sum(got) == args.batch * tokens, f"{sum(got)} tokens, expected {args.batch * tokens}"
    return args.batch * tokens / dt


try:
    grpc_round(4)  # warm-up: allocator, kernels, graphs
    http_round(4)
    grpc, http = [], []
    for _ in range(args.rounds):
        grpc.append(grpc_round(args.max_tokens))
        http.append(http_round(args.max_tokens))
finally:
    os.kill(info["pid"], signal.SIGTERM)
    engine.wait(timeout=120)

out = {"bench": "openai_vs_grpc", "date": datetime.date.today().isoformat(), "model": args.model,
       "device": args.device, "batch": args.batch, "prompt_words": args.prompt_len, "max_tokens": args.max_tokens,
       "stream": args.stream, "grpc_tokens_per_s": max(grpc), "openai_tokens_per_s": max(http),
       "openai_over_grpc": max(http) / max(grpc), "rounds": {"grpc": grpc, "openai": http}}
text = json.dumps(out)
print(text)
if args.out:
    Path(args.out).write_text(text + "\n")
