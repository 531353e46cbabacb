#!/usr/bin/env python3
"""GPU kernel time by kernel name from a Chrome trace written by `tiller bench train --profile`.
  kernel_summary.py TRACE.json [TOP]"""
import json, sys, collections
trace = json.load(open(sys.argv[1]))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
events = trace["traceEvents"] if isinstance(trace, dict) else trace
by = collections.defaultdict(lambda: [0.0, 0])
total = 0.0
for e in events:
    if e.get("cat") in ("kernel", "Kernel") and "dur" in e:
        name = e["name"]
        key = "nccl:" + name.split("(")[0] if "nccl" in name.lower() else name[:110]
        by[key][0] += e["dur"]
        by[key][1] += 1
        total += e["dur"]
print(f"kernels: {sum(c for _, c in by.values())}, GPU kernel time {total / 1e3:.1f} ms (NCCL included; it overlaps compute)")
for name, (us, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"{us / 1e3:9.2f} ms {n:6d}x  {name}")
