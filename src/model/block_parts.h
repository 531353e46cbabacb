// Pieces of block_forward that its FP8 form (fp8_block.cpp) shares with transformer.cpp.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "tiller/model/transformer.h"

namespace tiller::model {

// The attention of a layer's fused projection qkv [T, q_size + 2 kv_size] (bias and adapters
// added): RoPE unless the cache rotates, the q/k norms, the cache's (or the varlen) attention.
// [T, q_size], before the output projection.
at::Tensor attend_qkv(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& qkv,
                      BlockContext& ctx);

// Whether block_forward runs layer `w` as fp8_block_forward: ctx.fuse_residual and fp8_fused, the
// fused q/k/v and gate/up projections and o/down all tensor-scaled FP8, a dense MLP, no adapter in
// use, no tensor parallelism (each rank's partial sums would carry its own rows' scales), no FP8
// training.
bool fp8_fused_block(const LayerWeights& w, const BlockContext& ctx);

// block_forward (fuse_residual) of such a layer: the input norm and SwiGLU quantize their output
// rows in the same kernel, each GEMM runs tensor-wise with unit activation scales, and its rows'
// scales are applied by the kernel that reads it (the QKV bias add, the residual adds, SwiGLU):
// bit for bit what the unfused layer computes with fp8::linear on the same device
// (model/fp8_rows.h). Leaves ctx.deferred / deferred_scale for the next layer.
at::Tensor fp8_block_forward(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& x,
                             BlockContext& ctx);

}  // namespace tiller::model
