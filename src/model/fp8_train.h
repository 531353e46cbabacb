// FP8 training's tensor-scaled input, quantized once for the linears that read it (q/k/v and
// gate/up take the same normed x): model/fp8.cpp, used by model/transformer.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include "tiller/model/fp8.h"

namespace tiller::model::fp8 {

// x [..., K]'s scale and e4m3 codes for train_linear with tensor scaling on Hopper tensor cores
// (bf16 x): the forward's codes of x [M, K] ([round_up(M, 16), round_up(K, 16)]) and, where a
// weight gradient will be taken, x^T's codes ([round_up(K, 128), round_up(M, 128)], the weight
// gradient's operand), both from one read of x. Empty (undefined scale) where train_linear quantizes
// x itself: another scaling, the CPU, another dtype.
struct TrainInput {
  at::Tensor scale;    // [] fp32: tensor_scale(x)
  at::Tensor codes;    // x's codes
  at::Tensor codes_t;  // x^T's codes, or undefined without weight gradients
  bool defined() const { return scale.defined(); }
};
TrainInput train_input(const at::Tensor& x, Scaling scaling, bool weight_gradients);

// train_linear (tiller/model/fp8.h) with x's codes from `shared` (train_input of this x, or empty).
at::Tensor train_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Scaling scaling,
                        const TrainInput& shared, bool fast_accumulation = false);

// silu(x w_gate^T) * (x w_up^T), the dense MLP's first half, as one autograd node for tensor
// scaling on tensor cores: both projections from x's codes `in` (train_input of x; defined), and
// the SwiGLU kernel finding its product's scale and, in the backward, its two input gradients'
// scales, without passes of their own; the same values as the two train_linear and swiglu, bit for
// bit. `act_in` receives the product's codes for the down projection (with x^T's where
// `down_weight_gradient`). `fast_accumulation`: the two projections' as train_linear's. Undefined
// where it does not apply (weights not bf16 on x's GPU): the caller runs the projections and
// swiglu itself.
at::Tensor train_swiglu(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up, const TrainInput& in,
                        TrainInput& act_in, bool down_weight_gradient, bool fast_accumulation = false);

}  // namespace tiller::model::fp8
