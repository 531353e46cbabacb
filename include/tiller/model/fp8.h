// FP8 (e4m3) quantization, as the FP8 engine uses it (issue 58; docs/engine.md), in two scalings:
//   block    weights in 128x128 blocks with one fp32 scale each, in DeepSeek-V3's layout (a
//            checkpoint's `weight_scale_inv`: value = q * scale), activations in groups of 128
//            along the feature axis, one scale per token and group;
//   channel  one scale per weight row (output channel) and one per token (activation row), what
//            vLLM's FP8-dynamic checkpoints use;
//   tensor   one scale per weight and one per token (activation row), the token's applied after
//            cuBLASLt's tensor-wise GEMM (the fastest at decode's batch sizes, docs/benchmarks.md)
//            by the kernel that reads its output; the engine's norms and SwiGLU quantize their
//            output rows in the same pass (model/fp8_rows.h). FP8 training's tensor scaling
//            is one scale per operand of each GEMM (train_linear).
// A block's (group's, row's) scale maps its largest magnitude to e4m3's largest finite value, 448:
// scale = amax / 448 (1 for zeros), q = cast(x / scale), where cast is torch's float8_e4m3fn
// conversion (round to nearest even, subnormals down to 2^-9, saturating at +-448). The same on
// every device, so the CPU path quantizes exactly as the GPU's does and CPU tests check the numerics.
//
// Threading: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace tiller::model::fp8 {

constexpr double kE4m3Max = 448.0;
constexpr int64_t kBlock = 128;

enum class Scaling { kBlock, kChannel, kTensor };
// "block", "channel" or "tensor"; ConfigError naming `what` otherwise.
Scaling parse_scaling(const std::string& name, const std::string& what);
const char* scaling_name(Scaling s);

// A quantized 2-D weight [N, K]. `q_storage` [Np, Kp] float8_e4m3fn holds it zero-padded (the FP8
// GEMM's operand: whole blocks, K to 4 blocks, for block scaling; N and K to multiples of 16 for
// channel and tensor scaling). Block: `scale_storage` [ceil(N/block), Kp/block] fp32, one scale
// per block. Channel: `scale_storage` [Np] fp32, one scale per row (1 past N). Tensor:
// `scale_storage` [1]. `q` [N, K] is q_storage's view of the weight's own values and `scale` that
// of the scales themselves ([ceil(N/block), ceil(K/block)], [N], or [] for tensor). All on the
// weight's device.
struct QuantizedWeight {
  at::Tensor q, scale;
  at::Tensor q_storage, scale_storage;
  int64_t block = kBlock;
  Scaling scaling = Scaling::kBlock;
  bool defined() const { return q.defined(); }
  int64_t bytes() const;  // of both storages
};
QuantizedWeight quantize_blocks(const at::Tensor& w, int64_t block = kBlock);
// One scale per row (Scaling::kChannel).
QuantizedWeight quantize_channels(const at::Tensor& w);
// One scale for the whole weight (Scaling::kTensor).
QuantizedWeight quantize_tensor_weight(const at::Tensor& w);
QuantizedWeight quantize_weight(const at::Tensor& w, Scaling scaling);
// Quantizes `w` ([N, K], b's shape) into b's storages in place, in b's scaling: what
// quantize_blocks(w) or quantize_channels(w) returns, at the same addresses (a captured CUDA graph
// keeps reading them). On a GPU one kernel pass over the weight (no temporaries; the padding
// rewritten too); elsewhere a few block rows (a few thousand rows) at a time, so its temporaries
// stay small beside the weight.
void quantize_weight_into(const at::Tensor& w, QuantizedWeight& b);
// q * scale as `dtype` ([N, K]), in either scaling.
at::Tensor dequantize_weight(const QuantizedWeight& b, c10::ScalarType dtype);

// Activations [..., K] in groups of `group` along the last axis: q [..., K] float8_e4m3fn,
// scale [..., ceil(K/group)] fp32.
struct GroupQuantized {
  at::Tensor q;
  at::Tensor scale;
};
GroupQuantized quantize_groups(const at::Tensor& x, int64_t group = kBlock);
at::Tensor dequantize_groups(const GroupQuantized& g, c10::ScalarType dtype, int64_t group = kBlock);
// Activations [..., K] with one scale per token (row): q [..., K], scale [...] fp32.
GroupQuantized quantize_rows(const at::Tensor& x);
at::Tensor dequantize_rows(const GroupQuantized& g, c10::ScalarType dtype);
// Activations [..., K] with one scale for all of them: q [..., K], scale [] fp32 (what a
// tensor-scaled weight's quantization computes; tensor scaling's activations go per row).
GroupQuantized quantize_tensor(const at::Tensor& x);
// quantize_tensor(x)'s scale alone: amax / 448 over all of x (1 for zeros or none), [] fp32 on x's
// device (one pass over x on a GPU, which may be a transposed view).
at::Tensor tensor_scale(const at::Tensor& x);
at::Tensor dequantize_tensor(const GroupQuantized& g, c10::ScalarType dtype);

// x [..., K] times w^T (w [N, K] quantized) with x quantized to match (groups of the block size,
// rows for channel and tensor scaling): what an FP8 GEMM with fp32 accumulation computes,
// emulated (both dequantized, the product in fp32), plus `bias` ([N], optional) before the one
// rounding to x's dtype. [..., N]. Tensor scaling rounds twice, as its GEMM does: the product of
// x's codes and the weight to x's dtype, then that times the row's scale plus the bias
// (model/fp8_rows.h).
at::Tensor linear_emulated(const at::Tensor& x, const QuantizedWeight& w, const at::Tensor& bias = {});

// The same product on the device's FP8 tensor cores where there are some (Hopper: torch's
// _scaled_mm, block-, row- or tensor-scaled, fp32 accumulation; the activations quantized by one
// kernel; the bias in the epilogue, or for tensor scaling with the rows' scales after it), else
// linear_emulated. Inference only.
at::Tensor linear(const at::Tensor& x, const QuantizedWeight& w, const at::Tensor& bias = {});
// --- FP8 training (roles.<role>.fp8; docs/training.md "FP8 training") ---
// How one operand of a product is scaled along the product's contraction axis (K): one scale per
// row (kRows), per row and group of 128 (kGroups, the 1x128 layout), per 128x128 block (kBlocks), or
// one scale for the whole operand (kTensor).
enum class Operand { kRows, kGroups, kBlocks, kTensor };
// a [M, K] times b^T (b [N, K]) with both operands quantized now (current scaling) as `oa` and
// `ob` say, fp32 accumulation, plus `bias` ([N], optional) before the one rounding to `out`.
// Either operand may be a transposed view of a row-major tensor (the backward's gy^T, x^T, w^T):
// the GPU quantizes it by tiles without a transposed copy. On Hopper tensor cores (torch's
// _scaled_mm) for (kGroups, kBlocks), (kGroups, kGroups), (kRows, kRows) and (kTensor, kTensor)
// with bf16 out; emulated otherwise, or with `emulate`: the same quantization, the product in
// fp32. `scale_a` / `scale_b`: a tensor-scaled operand's scale when its caller has it already
// (tensor_scale of that operand, or of the tensor it is a view of): the same product without the
// pass that finds it. `fast_accumulation`: a tensor-scaled product on tensor cores without the
// fp32 promotion of the tensor cores' partial sums (tensor scaling only; the emulation ignores it).
at::Tensor scaled_product(const at::Tensor& a, const at::Tensor& b, Operand oa, Operand ob, c10::ScalarType out,
                          const at::Tensor& bias = {}, bool emulate = false, const at::Tensor& scale_a = {},
                          const at::Tensor& scale_b = {}, bool fast_accumulation = false);
// x [..., K] times w^T (w [N, K], as the ZeRO-3 gather made it) plus `bias`, as one autograd node
// whose three GEMMs run in FP8 with current scaling. The operands, by `scaling`:
//   block    forward  x in 1x128 groups, w in 128x128 blocks (DeepSeek-V3's recipe)
//            dgrad    the output gradient gy in 1x128 groups, w^T in blocks
//            wgrad    gy^T and x^T in groups of 128 tokens
//   channel  every operand one scale per row of the product's contraction (token, output or input
//            channel)
//   tensor   every operand one scale (its largest magnitude over the whole micro-batch or weight):
//            the fastest GEMMs, the coarsest scales
// Outputs and gradients in x's dtype; the bias gradient summed in fp32. Kept for the backward: x
// and w (what at::linear keeps; tensor scaling their two scales too), and the backward quantizes
// again; except tensor scaling on tensor cores (bf16), which keeps w, the scales and x^T's e4m3
// codes (half x's bytes), found with x's in the forward's one read of x, and reads gy once for both
// its layouts. `fast_accumulation` (roles.<role>.fp8_fast_accumulation): tensor scaling's forward
// GEMM on tensor cores accumulates without the fp32 promotion of the partial sums, as Transformer
// Engine's forward does; the gradients' GEMMs always promote.
at::Tensor train_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Scaling scaling,
                        bool fast_accumulation = false);

// Whether linear() runs on FP8 tensor cores on `device` (a GPU of compute capability 9.x in the
// GPU build, with block size 128).
bool tensor_cores(const at::Device& device);

}  // namespace tiller::model::fp8
