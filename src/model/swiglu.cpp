// SwiGLU, silu(g) * u, with a hand-written backward of two elementwise kernels:
//   d u = d act * silu(g),   d g = silu'(g) * (d act * u)
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

#include "tiller/core/error.h"
#include "tiller/model/transformer.h"

namespace tiller::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return at::silu(gate).mul_(up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    at::Tensor du = grads[0] * at::silu(g);
    at::Tensor dg = at::silu_backward(grads[0] * u, g);
    return {dg, du};
  }
};

}  // namespace

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  TILLER_CHECK(gate.sizes() == up.sizes(), "swiglu: gate and up shapes differ");
  return SwiGlu::apply(gate, up);
}

}  // namespace tiller::model
