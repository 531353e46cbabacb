#!/usr/bin/env python3
"""Held-out accuracy of a tool-using model (examples/tool_use/run.sh): the calculator agent of
examples/agents/calculator.py, greedy, against `tiller engine --openai-port` serving MODEL_DIR.

  eval.py TILLER MODEL_DIR EVAL_JSONL [--device cpu|cuda:0] [--limit N] [--concurrency 64]

Prints one JSON line: accuracy (the final reply holds the product), tool_rate (share of problems
where the model called the tool), calls_ok (share of calls whose expression was the problem's).
"""
import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agents"))
import httpx  # noqa: E402
from openai import OpenAI  # noqa: E402

from calculator import conversation  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("tiller")
ap.add_argument("model")
ap.add_argument("eval")
ap.add_argument("--device", default="cpu")
ap.add_argument("--limit", type=int, default=0)
ap.add_argument("--concurrency", type=int, default=64)
args = ap.parse_args()
rows = [json.loads(l) for l in open(args.eval) if l.strip()]
if args.limit > 0:
    rows = rows[:args.limit]

engine = subprocess.Popen([args.tiller, "engine", "--model", args.model, "--port", "0", "--openai-port", "0",
                           "--device", args.device, "--tool-call-parser", "hermes",
                           "--max-num-seqs", str(max(8, args.concurrency))],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, TILLER_ENGINE_TOKEN=""))
try:
    info = json.loads(engine.stdout.readline())
    client = OpenAI(base_url=f"http://127.0.0.1:{info['openai_port']}/v1", api_key="none", max_retries=0,
                    http_client=httpx.Client(timeout=300))

    def one(row):
        messages, answer, calls = conversation(client, args.model, row["input"], temperature=0)
        a, b = row["input"][len("What is "):-1].split(" * ")
        ok_calls = sum(1 for m in messages if m.get("tool_calls")
                       for c in m["tool_calls"] if json.loads(c["function"]["arguments"]).get("expression") == f"{a}*{b}")
        return row["label"] in answer, calls > 0, calls, ok_calls

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        got = list(pool.map(one, rows))
finally:
    os.kill(engine.pid, signal.SIGTERM)
    engine.wait(timeout=120)
n = len(got)
calls = sum(g[2] for g in got)
print(json.dumps({"model": args.model, "problems": n, "accuracy": round(sum(g[0] for g in got) / n, 4),
                  "tool_rate": round(sum(g[1] for g in got) / n, 4),
                  "calls_ok": round(sum(g[3] for g in got) / calls, 4) if calls else None}))
