// Autograd nodes with hand-written backwards for the memory-bound parts of a block:
//  - SwiGLU, silu(g) * u:  d u = d act * silu(g),  d g = silu'(g) * (d act * u); one fused CUDA
//    kernel each way in the GPU build (src/model/cuda/swiglu.cu)
//  - RoPE, x * cos + rotate_half(x) * sin: one fused CUDA kernel each way in the GPU build
//    (src/model/cuda/rope.cu), the same formulas in ATen ops elsewhere.
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/aten_dtype.h"
#endif

#include "model/batch_invariant.h"
#include "tiller/core/error.h"
#include "tiller/model/numerics.h"
#include "tiller/model/transformer.h"

namespace tiller::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#ifdef TILLER_HAVE_CUDA_KERNELS
// The fused SwiGLU kernels take these: CUDA, one floating dtype, 2-D with a contiguous inner dim.
bool swiglu_kernels_take(const at::Tensor& gate, const at::Tensor& up) {
  const at::ScalarType t = gate.scalar_type();
  return gate.is_cuda() && up.device() == gate.device() && up.scalar_type() == t && gate.dim() == 2 &&
         gate.stride(1) == 1 && up.stride(1) == 1 && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat);
}
#endif

// silu(gate) * up: on CUDA one kernel each way (forward: one read of gate and up, one write;
// backward: one read of gate, up and the gradient, one write of each input gradient).
struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    if (batch_invariant()) return invariant::swiglu_forward(gate, up);
#ifdef TILLER_HAVE_CUDA_KERNELS
    if (swiglu_kernels_take(gate, up)) {
      at::Tensor out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
      cuda::swiglu(cuda::kernel_dtype(gate.scalar_type()), gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                   out.data_ptr(), gate.size(0), gate.size(1),
                   c10::cuda::getCurrentCUDAStream(gate.device().index()).stream());
      return out;
    }
#endif
    return at::silu(gate).mul_(up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
#ifdef TILLER_HAVE_CUDA_KERNELS
    if (swiglu_kernels_take(g, u) && grads[0].scalar_type() == g.scalar_type()) {
      const at::Tensor gc = g.contiguous(), uc = u.contiguous(), d = grads[0].contiguous();
      at::Tensor dg = at::empty_like(gc), du = at::empty_like(uc);
      cuda::swiglu_backward(cuda::kernel_dtype(g.scalar_type()), gc.data_ptr(), uc.data_ptr(), d.data_ptr(),
                            dg.data_ptr(), du.data_ptr(), g.size(0), g.size(1),
                            c10::cuda::getCurrentCUDAStream(g.device().index()).stream());
      return {dg, du};
    }
#endif
    at::Tensor du = grads[0] * at::silu(g);
    at::Tensor dg = at::silu_backward(grads[0] * u, g);
    return {dg, du};
  }
};

#ifdef TILLER_HAVE_CUDA_KERNELS
using cuda::kernel_dtype;
#endif

// x [T, H, D]; cos, sin [T, D]. Forward: x c + rotate_half(x) s. Backward (x is then the output
// gradient g): g c + rotate_half^T(g s), where rotate_half^T(y) = [y2, -y1].
at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (x.is_cuda() && x.dim() == 3 && x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
      cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
      (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat)) {
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    const auto dtype = kernel_dtype(x.scalar_type());
    cuda::rope(dtype, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), x.size(0), x.size(1), x.size(2),
               x.stride(0), x.stride(1), backward, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return out;
  }
#endif
  const int64_t half = x.size(-1) / 2;
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  if (!backward) return x * c + at::cat({-x2, x1}, -1) * s;
  const at::Tensor gs = x * s;
  return x * c + at::cat({gs.narrow(-1, half, half), -gs.narrow(-1, 0, half)}, -1);
}

struct RopeNode : public torch::autograd::Function<RopeNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    if (batch_invariant()) return invariant::rope_forward(x, cos, sin);
    return rope_apply(x, cos, sin, false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {rope_apply(grads[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TILLER_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                   sin.sizes() == cos.sizes(),
               "apply_rope: x [T, H, D] and tables [T, D] expected");
  return RopeNode::apply(x, cos.to(x.scalar_type()), sin.to(x.scalar_type()));
}

at::Tensor swiglu_packed(const at::Tensor& gate_up) {
  TILLER_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "swiglu_packed wants [tokens, 2 * width]");
  TILLER_CHECK(!(gate_up.requires_grad() && at::GradMode::is_enabled()), "swiglu_packed has no backward");
  const int64_t width = gate_up.size(1) / 2;
  if (batch_invariant())
    return invariant::swiglu_forward(gate_up.narrow(1, 0, width), gate_up.narrow(1, width, width));
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (gate_up.is_cuda() && gate_up.stride(1) == 1 &&
      (gate_up.scalar_type() == at::kBFloat16 || gate_up.scalar_type() == at::kHalf ||
       gate_up.scalar_type() == at::kFloat)) {
    at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
    cuda::swiglu_packed(kernel_dtype(gate_up.scalar_type()), gate_up.data_ptr(), out.data_ptr(), gate_up.size(0), width,
                        gate_up.stride(0), c10::cuda::getCurrentCUDAStream(gate_up.device().index()).stream());
    return out;
  }
#endif
  return at::silu(gate_up.narrow(1, 0, width)).mul_(gate_up.narrow(1, width, width));
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& add, const at::Tensor& weight, double eps) {
  TILLER_CHECK(x.dim() == 2 && add.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
               "add_rms_norm wants x, add [T, width] and weight [width]");
  TILLER_CHECK(!(at::GradMode::is_enabled() && (x.requires_grad() || add.requires_grad())),
               "add_rms_norm has no backward");
  if (batch_invariant()) return invariant::add_rms_norm(x, add, weight, eps);
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = x.scalar_type();
  if (x.is_cuda() && x.stride(1) == 1 && add.stride(1) == 1 && weight.is_contiguous() && add.scalar_type() == t &&
      weight.scalar_type() == t && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat)) {
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    cuda::add_rms_norm(kernel_dtype(t), x.data_ptr(), add.data_ptr(), weight.data_ptr(), out.data_ptr(), x.size(0),
                       x.size(1), x.stride(0), add.stride(0), out.stride(0), static_cast<float>(eps),
                       c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return out;
  }
#endif
  x.add_(add);
  return rms_norm(x, weight, eps);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  TILLER_CHECK(gate.sizes() == up.sizes(), "swiglu: gate and up shapes differ");
  return SwiGlu::apply(gate, up);
}

}  // namespace tiller::model
