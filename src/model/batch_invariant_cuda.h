// The CUDA forms of the batch-invariant operations (batch_invariant.h), over the kernels of
// src/model/cuda/ (kernels.h): bf16, fp16 and fp32 tensors on the GPU. Private to src/model;
// compiled in the GPU build only.
#pragma once

#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/attention.h"

namespace tiller::model::invariant {

// The current CUDA stream of t's device.
void* stream_of(const at::Tensor& t);

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);
at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor softmax_cuda(const at::Tensor& x);
std::pair<at::Tensor, at::Tensor> rope_tables_cuda(const at::Tensor& freqs, double scaling);
// The trainer's (and the engine's prefill) attention in the engine's decode kernel's order: its
// prefill form where the tensor-core kernel serves the shape (PrefillRows, 16 tokens a tile),
// else each query as a decode step over its own keys (PagedDecode::key_base); one split either
// way, so a query sums its keys as a decode step of the same token does.
at::Tensor attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& s,
                          double scale);
at::Tensor logprobs_cuda(const at::Tensor& logits, const at::Tensor& targets, const std::vector<float>& temperatures,
                         at::Tensor* entropy);

}  // namespace tiller::model::invariant
