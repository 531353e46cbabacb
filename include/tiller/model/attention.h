// Causal attention over packed variable-length sequences.
//
// q: [Tq, heads, head_dim], k and v: [Tk, kv_heads, head_dim] (grouped-query: heads is a
// multiple of kv_heads). Sequence i owns rows cu_q[i]..cu_q[i+1] of q and cu_k[i]..cu_k[i+1] of
// k/v. The causal mask is aligned to the end of each sequence (query j of a sequence with Lq
// queries and Lk keys sees keys up to j + Lk - Lq), so one call covers training (Lq == Lk) and
// decoding against cached keys (Lq < Lk). A window w > 0 limits each query to the w keys ending
// at its own position.
//
// Backends: kReference is exact softmax attention per sequence in fp32 (any device and dtype,
// differentiable); kFlash is ATen's varlen flash attention (CUDA, bf16/fp16, head_dim a multiple
// of 8 up to 256; differentiable). kAuto picks flash when it applies.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tiller::model {

enum class AttentionBackend { kAuto, kReference, kFlash };

struct VarlenSpec {
  at::Tensor cu_q, cu_k;            // int32 [B+1], on the device of q
  std::vector<int64_t> lens_q, lens_k;  // host copies of the lengths
  int64_t max_q = 0, max_k = 0;
  int64_t window = 0;               // 0: unlimited

  // Lq == Lk for every sequence (no cache).
  static VarlenSpec self(const at::Tensor& cu, std::vector<int64_t> lens);
};

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& spec,
                            double scale, AttentionBackend backend = AttentionBackend::kAuto);

// Whether kFlash can run these inputs (device, dtype, head_dim).
bool flash_attention_applies(const at::Tensor& q);

}  // namespace tiller::model
