#!/usr/bin/env python3
"""On the GPU host: FP8 training's GEMMs (roles.<r>.fp8, model/fp8.h train_linear) at one 7B layer's
seven projections and M tokens (default 8,192: bench train's micro-batch of 4 x 2,048), in bf16 and
in torch's `_scaled_mm` with each scaling cuBLASLt takes: groups x blocks (1x128 activations, 128x128
weights: the forward and dgrad now), groups x groups (both 1x128: the wgrad now), tensor-wise. The
passes: forward x [M, K] . w^T, dgrad gy [M, N] . w, wgrad gy^T . x (the contraction over tokens).
Microseconds per layer (the seven GEMMs of the pass) and TFLOP/s; the codes and scales are
constant (the kernels' speed does not depend on them). Also tensor-wise with cuBLASLt's fast
accumulation (`use_fast_accum`: no fp32 promotion of the tensor cores' partial sums, Transformer
Engine's choice for the forward), and tensor-wise over the fused shapes (q/k/v as one [4608, K]
weight, gate/up as one [37888, K]: one GEMM each instead of three and two). Prints JSON lines.
    python3 scripts/gpu/fp8_train_gemm_forms.py [M] > forms.jsonl
"""
import json, sys, torch

M = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
dev = "cuda"
f8 = torch.float8_e4m3fn
# (N, K) of q, k, v, o, gate, up, down at Qwen2.5-7B
mats = [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944)]
# the same layer with q/k/v and gate/up fused
fused = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def operands(pass_, n, k):
    """(rows, inner, cols) of a [rows, inner] . b[cols, inner]^T for the pass."""
    if pass_ == "forward":
        return M, k, n
    if pass_ == "dgrad":
        return M, n, k
    return n, M, k  # wgrad: gy^T [N, M] . (x^T [K, M])^T


def layer(pass_, shapes):
    """The pass's operands for each (N, K) of `shapes`, and its FLOPs."""
    gemms = []
    flop = 0
    for n, k in shapes:
        r, inner, c = operands(pass_, n, k)
        flop += 2 * r * inner * c
        a16 = torch.randn(r, inner, device=dev, dtype=torch.bfloat16)
        b16 = torch.randn(c, inner, device=dev, dtype=torch.bfloat16)
        a8, b8 = a16.to(f8), b16.to(f8)
        one = torch.ones((), device=dev)
        ga = torch.ones(inner // 128, r, device=dev).t()  # 1x128 groups, the first operand's layout
        gb = torch.ones(inner // 128, c, device=dev)  # 1x128 groups as the second operand
        bb = torch.ones(c // 128, inner // 128, device=dev).t()  # 128x128 blocks as the second operand
        gemms.append((a16, b16, a8, b8, one, ga, gb, bb))
    return gemms, flop


for pass_ in ("forward", "dgrad", "wgrad"):
    res = {"M": M, "pass": pass_}
    tensor = lambda g: torch._scaled_mm(g[2], g[3].t(), g[4], g[4], out_dtype=torch.bfloat16)
    fast = lambda g: torch._scaled_mm(g[2], g[3].t(), g[4], g[4], out_dtype=torch.bfloat16, use_fast_accum=True)
    forms = {
        "bf16": (lambda g: torch.mm(g[0], g[1].t()), mats),
        "groups_x_blocks": (lambda g: torch._scaled_mm(g[2], g[3].t(), g[5], g[7], out_dtype=torch.bfloat16), mats),
        "groups_x_groups": (lambda g: torch._scaled_mm(g[2], g[3].t(), g[5], g[6], out_dtype=torch.bfloat16), mats),
        "tensor": (tensor, mats),
        "tensor_fast_accum": (fast, mats),
        "tensor_fused": (tensor, fused),
        "tensor_fused_fast_accum": (fast, fused),
    }
    built = {}
    for name, (f, shapes) in forms.items():
        key = "fused" if shapes is fused else "separate"
        if key not in built:
            built.clear()  # one layer's operands on the GPU at a time
            built[key] = layer(pass_, shapes)
        gemms, flop = built[key]
        try:
            us = timed(lambda: [f(g) for g in gemms])
            res[name + "_us"] = round(us, 1)
            res[name + "_tflops"] = round(flop / us / 1e6, 0)
        except Exception as e:  # a form cuBLASLt refuses
            res[name + "_us"] = str(e).splitlines()[0][:100]
    print(json.dumps(res), flush=True)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}))
