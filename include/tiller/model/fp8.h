// FP8 (e4m3) quantization, as the FP8 engine and FP8 training use it (issue 58; docs/engine.md):
// weights in 128x128 blocks with one fp32 scale each, in DeepSeek-V3's layout (a checkpoint's
// `weight_scale_inv`: value = q * scale), and activations in groups of 128 along the feature axis,
// one scale per token and group, as the peers' FP8 rollouts quantize them. A block's (group's)
// scale maps its largest magnitude to e4m3's largest finite value, 448: scale = amax / 448 (1 for
// a block of zeros), q = cast(x / scale), where cast is torch's float8_e4m3fn conversion (round to
// nearest even, subnormals down to 2^-9, saturating at +-448). The same on every device, so the
// CPU path quantizes exactly as the GPU's does and CPU tests check the numerics.
//
// Threading: pure functions of their arguments.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace tiller::model::fp8 {

constexpr double kE4m3Max = 448.0;
constexpr int64_t kBlock = 128;

// A 2-D weight [N, K] in blocks: q [N, K] float8_e4m3fn, scale [ceil(N/block), ceil(K/block)] fp32
// on q's device (edge blocks cover what is left of N and K).
struct BlockQuantized {
  at::Tensor q;
  at::Tensor scale;
};
BlockQuantized quantize_blocks(const at::Tensor& w, int64_t block = kBlock);
// q * scale as `dtype` ([N, K]).
at::Tensor dequantize_blocks(const BlockQuantized& b, c10::ScalarType dtype, int64_t block = kBlock);

// Activations [..., K] in groups of `group` along the last axis: q [..., K] float8_e4m3fn,
// scale [..., ceil(K/group)] fp32.
struct GroupQuantized {
  at::Tensor q;
  at::Tensor scale;
};
GroupQuantized quantize_groups(const at::Tensor& x, int64_t group = kBlock);
at::Tensor dequantize_groups(const GroupQuantized& g, c10::ScalarType dtype, int64_t group = kBlock);

// x [..., K] times w^T (w [N, K] in blocks) with x quantized in groups of the same size: what an
// FP8 GEMM with fp32 accumulation computes, emulated (both dequantized, the product in fp32).
// Returned in x's dtype, [..., N].
at::Tensor linear_emulated(const at::Tensor& x, const BlockQuantized& w, int64_t block = kBlock);

}  // namespace tiller::model::fp8
