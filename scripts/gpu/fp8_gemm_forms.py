#!/usr/bin/env python3
"""On the GPU host: one decode layer's four projections (q/k/v fused, o, gate/up fused, down) of the
Qwen2.5 shapes at decode's row counts M, bf16 `mm` against torch's FP8 `_scaled_mm` in each scaling
(tensor-wise, row-wise, 128x128 blocks), with fp32 accumulation and with fast accumulation where
cuBLASLt allows it. Each form runs 10 times per CUDA graph; the time is per layer (the four GEMMs),
in microseconds. The floors: max(FLOPs / peak, weight bytes / 4.8 TB/s) with H100/H200's dense
peaks (989 TFLOP/s bf16, 1979 FP8). Then the kernel each FP8 form picks at 7B's gate/up, M = 256.
Prints JSON lines (docs/benchmarks.md, "FP8 GEMM forms at decode's sizes").
    python3 scripts/gpu/fp8_gemm_forms.py > forms.jsonl
"""
import json, sys, torch
torch.manual_seed(0)
dev = "cuda"
shapes = {"7b": [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
          "1.5b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
          "0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864)]}
f8 = torch.float8_e4m3fn
def bench(fn, iters=50):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(10): fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(iters): g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / (iters * 10)  # us per call of fn
for model, mats in shapes.items():
    for M in (64, 128, 256, 512):
        res = {"model": model, "M": M}
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in mats]
        xs = [torch.randn(M, k, device=dev, dtype=torch.bfloat16) for n, k in mats]
        wq = [w.to(f8) for w in ws]; xq = [x.to(f8) for x in xs]
        one = torch.ones((), device=dev)
        rs_a = [torch.ones(M, 1, device=dev) for _ in mats]
        rs_b = [torch.ones(1, n, device=dev) for n, k in mats]
        bs_a = [torch.ones(k // 128, M, device=dev).t() for n, k in mats]
        bs_b = [torch.ones(n // 128, k // 128, device=dev).t() for n, k in mats]
        def run(kind, fast=False):
            def f():
                for i in range(4):
                    if kind == "bf16": torch.mm(xs[i], ws[i].t())
                    elif kind == "tensor": torch._scaled_mm(xq[i], wq[i].t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)
                    elif kind == "row": torch._scaled_mm(xq[i], wq[i].t(), rs_a[i], rs_b[i], out_dtype=torch.bfloat16, use_fast_accum=fast)
                    elif kind == "block": torch._scaled_mm(xq[i], wq[i].t(), bs_a[i], bs_b[i], out_dtype=torch.bfloat16, use_fast_accum=fast)
            return f
        for name, kind, fast in [("bf16", "bf16", False), ("tensor", "tensor", False), ("tensor_fast", "tensor", True),
                                 ("row", "row", False), ("row_fast", "row", True), ("block", "block", False), ("block_fast", "block", True)]:
            try: res[name] = round(bench(run(kind, fast)), 1)
            except Exception as e: res[name] = str(e).splitlines()[0][:80]
        flop = sum(2 * M * n * k for n, k in mats); wbytes = sum(n * k for n, k in mats)
        res["fp8_floor_us"] = round(max(flop / 1979e12, wbytes / 4.8e12) * 1e6, 1)
        res["bf16_floor_us"] = round(max(flop / 989e12, 2 * wbytes / 4.8e12) * 1e6, 1)
        print(json.dumps(res), flush=True)
# kernel names at M=256, 7b gate_up
from torch.profiler import profile, ProfilerActivity
n, k = 37888, 3584
w = (torch.randn(n, k, device=dev) * 0.02).to(f8); x = torch.randn(256, k, device=dev).to(f8); one = torch.ones((), device=dev)
with profile(activities=[ProfilerActivity.CUDA]) as p:
    torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
    torch._scaled_mm(x, w.t(), torch.ones(256, 1, device=dev), torch.ones(1, n, device=dev), out_dtype=torch.bfloat16, use_fast_accum=True)
    torch._scaled_mm(x, w.t(), torch.ones(256, 1, device=dev), torch.ones(1, n, device=dev), out_dtype=torch.bfloat16, use_fast_accum=False)
    torch.cuda.synchronize()
for e in p.key_averages(): 
    if e.device_type.name == "CUDA" or "CUDA" in str(e.device_type): print("kernel", e.key[:150])
print("torch", torch.__version__, torch.version.cuda)
