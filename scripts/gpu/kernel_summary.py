#!/usr/bin/env python3
"""GPU kernel time by kernel name from a Chrome trace written by `tiller bench train --profile`
or `tiller bench generate --profile`. With STEPS (the steps the trace covers), also per step:
kernels, GPU busy time (the union of kernel intervals), and the span from the first kernel's
start to the last one's end; span - busy is the time the GPU stood idle between kernels.
  kernel_summary.py TRACE.json [TOP] [STEPS]"""
import json, sys, collections
trace = json.load(open(sys.argv[1]))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 0
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
if steps > 0:
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") in ("kernel", "Kernel") and "dur" in e)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a >= end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    print(f"per step ({steps} steps): {len(spans) / steps:.0f} kernels, GPU busy {busy / steps / 1e3:.3f} ms, "
          f"span {span / steps / 1e3:.3f} ms, idle between kernels {(span - busy) / steps / 1e3:.3f} ms")
