// Tensor scaling's activations (engines.fp8_scaling: tensor; model/fp8.h): one scale per token,
// applied after cuBLASLt's tensor-wise FP8 GEMM by whatever reads its output. The GEMM takes
// unit activation scales, so its output is each row's product divided by the row's scale; the
// kernels that read it (the residual add before a norm, SwiGLU, the QKV bias) multiply the
// scale back in, and the norm and SwiGLU quantize their own output rows for the next GEMM in the
// same pass (docs/engine.md, "FP8 engines"). Each fused function equals, bit for bit on one
// device, the unfused sequence it names (scale_rows_, then the plain op, then quantize_row_codes);
// on the CPU it is that sequence.
//
// Threading: pure functions of their arguments (unit_scale: one lock).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "tiller/model/fp8.h"

namespace tiller::model::fp8 {

// Activations [rows, k] quantized one scale per row, in the layout the tensor-wise GEMM reads.
struct RowCodes {
  at::Tensor q;      // float8_e4m3fn [round_up(rows, 16), round_up(k, 16)], zeros past rows and k
  at::Tensor scale;  // fp32 [round_up(rows, 16)], 1 past rows
  int64_t rows = 0, k = 0;
};

// x [rows, k] (inner stride 1): quantize_rows()'s codes and scales, padded.
RowCodes quantize_row_codes(const at::Tensor& x);

// a's codes times w^T (w tensor-scaled), without a's row scales: [a.rows, N] in `dtype`, each
// value (codes . w's codes) * w's scale, rounded once (fp32 accumulation). On Hopper's tensor
// cores unless `emulate` (then in fp32 on a's device, over the dequantized weight).
at::Tensor unscaled_product(const RowCodes& a, const QuantizedWeight& w, at::ScalarType dtype, bool emulate = false);

// y [rows, n] (inner stride 1) = y * scale[row] (+ bias[col]) in place: the fp32 product and the
// fp32 sum each rounded, then rounded to y's dtype.
void scale_rows_(const at::Tensor& y, const at::Tensor& scale, const at::Tensor& bias = {});

// x [..., K] times w^T (tensor-scaled) plus bias, through the three above: what fp8::linear and
// linear_emulated compute for tensor scaling.
at::Tensor tensor_scaled_linear(const at::Tensor& x, const QuantizedWeight& w, const at::Tensor& bias, bool emulate);

// x += add (add's rows times add_scale first when add_scale is defined, as scale_rows_ rounds
// them), then rms_norm(x)'s rows quantized: quantize_row_codes(add_rms_norm(x, add, weight, eps)).
RowCodes add_rms_norm_codes(at::Tensor& x, const at::Tensor& add, const at::Tensor& add_scale,
                            const at::Tensor& weight, double eps);

// swiglu_packed(gate_up with its rows times `scale`), its rows quantized:
// quantize_row_codes(swiglu_packed(scale_rows_(gate_up, scale))), gate_up itself left as it is.
RowCodes swiglu_codes(const at::Tensor& gate_up, const at::Tensor& scale);

// fp32 [1] holding 1 on `device`: the activations' scale of an unscaled product. Made once per
// device (quantize_tensor_weight makes it, before any CUDA graph's capture could need it).
const at::Tensor& unit_scale(const at::Device& device);

}  // namespace tiller::model::fp8
