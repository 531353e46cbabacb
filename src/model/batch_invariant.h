// The batch-invariant forward kernels of Numerics::kBatchInvariant (tiller/model/numerics.h),
// private to src/model. Each output row is computed from its own inputs alone, with reductions
// in one fixed order that depends only on their length:
//  - a dot product of length K sums into 8 lanes (element k into lane k % 8, in k order) and
//    adds the lanes as ((0+1)+(2+3))+((4+5)+(6+7)); in fp32 (fp64 for fp64 inputs), the result
//    rounded once to the output type;
//  - attention sums a query's keys in key order (scores, max, exp, the normaliser and the
//    weighted values);
//  - elementwise kernels (RoPE, SwiGLU) compute in fp32 and round once.
// CPU tensors of fp32, fp64, bf16 and fp16. The differentiable ones take their gradient from the
// ordinary formulas (the backward need not be invariant).
//
// On CUDA (bf16, fp16, fp32; model/cuda/kernels.h) the orders differ from the CPU's but hold the
// same property, for the engine's and the trainer's GPUs alike:
//  - matmuls: cuBLASLt without split-K; per (device, dtype, K) a reference algorithm whose rows
//    a probe finds independent of M, and per shape the fastest algorithm that gives the
//    reference's bits on the probe (invariant_gemm.cpp);
//  - attention: every query, the trainer's and the engine's prefill included, runs through the
//    engine's decode kernel with one KV split, so it sums its keys as a decode step does;
//  - RMSNorm, the router's softmax and the log-prob head: one thread block per row, scalar loads
//    in a fixed order (invariant.cu); RoPE and SwiGLU: the ordinary elementwise kernels, one for
//    the engine's packed and the trainer's split forms.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/attention.h"

namespace tiller::model::invariant {

// x [..., K] @ w[N, K]^T (+ b[N]) -> [..., N] in x's dtype. Differentiable.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});
// RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight, in x's dtype. Differentiable.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// x += add (in place, in x's dtype), then rms_norm of it: on CUDA one kernel of the same bits as
// the two steps. Inference only.
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& add, const at::Tensor& weight, double eps);
// silu(gate) * up, in gate's dtype. Forward only: fused_ops.cpp's SwiGLU node runs it under the
// mode and keeps its own backward.
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
// x [T, H, D] * cos + rotate_half(x) * sin with tables [T, D] in x's dtype. Forward only, likewise
// (fused_ops.cpp's RoPE node).
at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// Causal varlen attention (attention.h's layout and mask), forward only: [Tq, H, D] in q's dtype.
at::Tensor attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& spec,
                             double scale);
// softmax over the last dim of x [R, C], in fp32 (fp64 for fp64 x): a mixture of experts' router.
// Differentiable.
at::Tensor softmax(const at::Tensor& x);
// log softmax(logits[r] / temperature[r])[targets[r]] per row, fp32 [R] (fp64 for fp64 logits).
// `temperatures`: one per row, or one for all. Not differentiable.
// With `entropy`, also each row's entropy of softmax(logits / temperature) into it (not part of
// the invariance promise; on CUDA from the same pass).
at::Tensor logprobs(const at::Tensor& logits, const at::Tensor& targets, const std::vector<float>& temperatures,
                    at::Tensor* entropy = nullptr);
// cos and sin of freqs [T, D] (fp32), times `scaling`, element by element (no vector path whose
// result depends on where an element sits): on the CPU with the C library's functions, on CUDA
// with CUDA's (on the tensor's device; the two differ in the last bits, and each side of the
// bitwise promise runs on one kind of device).
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& freqs, double scaling);

// The one-line error for a tensor the kernels do not take (CUDA tensors of fp64, or any CUDA
// tensor in a build without CUDA kernels).
void check_device(const at::Tensor& t, const char* what);

}  // namespace tiller::model::invariant
