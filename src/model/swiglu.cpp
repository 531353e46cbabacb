// SwiGLU on the fused gate|up projection: silu(g) * u, with a hand-written backward
//   d g = d act * u * silu'(g),   d u = d act * silu(g)
// written straight into the two halves of one [T, 2I] gradient.
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

#include "tiller/core/error.h"
#include "tiller/model/transformer.h"

namespace tiller::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    ctx->save_for_backward({gate_up});
    const int64_t half = gate_up.size(-1) / 2;
    return at::silu(gate_up.narrow(-1, 0, half)).mul_(gate_up.narrow(-1, half, half));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor gate_up = ctx->get_saved_variables()[0];
    const int64_t half = gate_up.size(-1) / 2;
    const at::Tensor g = gate_up.narrow(-1, 0, half), u = gate_up.narrow(-1, half, half);
    at::Tensor d = at::empty_like(gate_up, at::MemoryFormat::Contiguous);
    at::Tensor dg = d.narrow(-1, 0, half), du = d.narrow(-1, half, half);
    at::mul_out(du, grads[0], at::silu(g));
    at::silu_backward_out(dg, grads[0] * u, g);
    return {d};
  }
};

}  // namespace

at::Tensor swiglu(const at::Tensor& gate_up) {
  TILLER_CHECK(gate_up.size(-1) % 2 == 0, "swiglu: last dimension {} is odd", gate_up.size(-1));
  return SwiGlu::apply(gate_up);
}

}  // namespace tiller::model
