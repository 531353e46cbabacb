// FP8 (e4m3) block and group quantization (model/fp8.h).
#include "tiller/model/fp8.h"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/aten_dtype.h"
#endif

#include "model/fp8_rows.h"
#include "model/fp8_train.h"
#include "tiller/core/error.h"

namespace tiller::model::fp8 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_size(int64_t block, const char* what) {
  if (block < 1 || block > 4096) throw ConfigError(fmt::format("fp8: {} size {} is not in [1, 4096]", what, block));
}

// amax / 448, and 1 where amax is 0 (a block of zeros stays zeros whatever its scale).
// The divisor is a tensor, not a scalar: ATen's CUDA division by a scalar multiplies by its
// reciprocal, which is not the IEEE quotient the CPU (and the activation kernel) computes.
at::Tensor scale_of(const at::Tensor& amax) {
  return at::where(amax > 0, amax / at::full({}, kE4m3Max, amax.options()), at::ones_like(amax));
}

// `x` [n, k] zero-padded to whole blocks and seen as [nb, block, kb, block] (zeros change no
// block's largest magnitude); the scales then apply by broadcasting, without an expanded copy.
at::Tensor as_blocks(const at::Tensor& x, int64_t block) {
  const int64_t n = x.size(0), k = x.size(1), nb = ceil_div(n, block), kb = ceil_div(k, block);
  return at::constant_pad_nd(x, {0, kb * block - k, 0, nb * block - n}, 0).view({nb, block, kb, block});
}
// The inverse: [nb, block, kb, block] back to [n, k].
at::Tensor from_blocks(const at::Tensor& b, int64_t n, int64_t k) {
  return b.view({b.size(0) * b.size(1), b.size(2) * b.size(3)}).narrow(0, 0, n).narrow(1, 0, k);
}

// `x` [..., k] zero-padded to whole groups and seen as [..., g, group].
at::Tensor as_groups(const at::Tensor& x, int64_t group) {
  const int64_t k = x.size(-1), g = ceil_div(k, group);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(g);
  shape.push_back(group);
  return at::constant_pad_nd(x, {0, g * group - k}, 0).view(shape);
}
at::Tensor from_groups(const at::Tensor& g, int64_t k) {
  std::vector<int64_t> shape(g.sizes().begin(), g.sizes().end() - 2);
  shape.push_back(g.size(-2) * g.size(-1));
  return g.reshape(shape).narrow(-1, 0, k);
}

int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Block rows quantized at a time by quantize_weight_into: about 2^24 elements of fp32 temporaries.
int64_t block_rows_per_chunk(int64_t k, int64_t block) {
  return std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, round_up(k, block) * block));
}

}  // namespace

int64_t QuantizedWeight::bytes() const {
  return (q_storage.defined() ? q_storage.numel() * q_storage.element_size() : 0) +
         (scale_storage.defined() ? scale_storage.numel() * scale_storage.element_size() : 0);
}

Scaling parse_scaling(const std::string& name, const std::string& what) {
  if (name == "block") return Scaling::kBlock;
  if (name == "channel") return Scaling::kChannel;
  if (name == "tensor") return Scaling::kTensor;
  throw ConfigError(fmt::format("{} '{}': use block, channel or tensor", what, name));
}

const char* scaling_name(Scaling s) {
  switch (s) {
    case Scaling::kBlock: return "block";
    case Scaling::kChannel: return "channel";
    case Scaling::kTensor: return "tensor";
  }
  return "?";
}

namespace {

// The storages of channel and tensor scaling: codes [Np, Kp] (N and K to multiples of 16), and one
// scale per padded row (channel, [Np], 1 past N) or one scale ([1], seen as []).
QuantizedWeight padded_rows_or_tensor(const at::Tensor& w, Scaling scaling) {
  if (w.dim() != 2) throw ConfigError(fmt::format("fp8: a quantized weight is 2-D, not {}-D", w.dim()));
  const int64_t n = w.size(0), k = w.size(1), np = round_up(n, 16);
  QuantizedWeight b;
  b.scaling = scaling;
  b.q_storage = at::zeros({np, round_up(k, 16)}, w.options().dtype(at::kFloat8_e4m3fn));
  b.scale_storage = at::ones({scaling == Scaling::kChannel ? np : 1}, w.options().dtype(at::kFloat));
  b.q = b.q_storage.narrow(0, 0, n).narrow(1, 0, k);
  // [] for tensor scaling (view({}) would pick the dtype overload).
  b.scale = scaling == Scaling::kChannel ? b.scale_storage.narrow(0, 0, n) : b.scale_storage.squeeze(0);
  quantize_weight_into(w, b);
  return b;
}

}  // namespace

QuantizedWeight quantize_channels(const at::Tensor& w) { return padded_rows_or_tensor(w, Scaling::kChannel); }

QuantizedWeight quantize_tensor_weight(const at::Tensor& w) {
  if (w.is_cuda()) unit_scale(w.device());  // the GEMM's activation scale, made before any capture
  return padded_rows_or_tensor(w, Scaling::kTensor);
}

QuantizedWeight quantize_weight(const at::Tensor& w, Scaling scaling) {
  switch (scaling) {
    case Scaling::kChannel: return quantize_channels(w);
    case Scaling::kTensor: return quantize_tensor_weight(w);
    case Scaling::kBlock: break;
  }
  return quantize_blocks(w);
}

QuantizedWeight quantize_blocks(const at::Tensor& w, int64_t block) {
  check_size(block, "block");
  if (w.dim() != 2) throw ConfigError(fmt::format("fp8: a block-quantized weight is 2-D, not {}-D", w.dim()));
  // K is padded to a multiple of 4 blocks: cuBLASLt's block-scaled GEMM reads the weight scales'
  // rows as if 16-byte aligned (measured on H200: other widths give wrong products, unflagged).
  const int64_t n = w.size(0), k = w.size(1), nb = ceil_div(n, block), kb = round_up(ceil_div(k, block), 4);
  QuantizedWeight b;
  b.block = block;
  b.q_storage = at::zeros({nb * block, kb * block}, w.options().dtype(at::kFloat8_e4m3fn));
  b.scale_storage = at::ones({nb, kb}, w.options().dtype(at::kFloat));
  b.q = b.q_storage.narrow(0, 0, n).narrow(1, 0, k);
  b.scale = b.scale_storage.narrow(1, 0, ceil_div(k, block));
  quantize_weight_into(w, b);
  return b;
}

void quantize_weight_into(const at::Tensor& w, QuantizedWeight& b) {
  TILLER_CHECK(b.defined() && w.dim() == 2 && w.sizes() == b.q.sizes() && w.device() == b.q.device(),
               "fp8: a weight of {} elements on {} does not fit its quantized form", w.numel(), w.device().str());
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = w.scalar_type();
  if (w.is_cuda() && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat) &&
      (b.scaling != Scaling::kBlock || b.block == kBlock) && b.q_storage.is_contiguous() &&
      b.scale_storage.is_contiguous()) {
    // One pass of one kernel over the weight, padding included (zeros, scale 1): the tile kernel
    // for blocks, the row kernel for channels; the same codes and scales as the chunks below.
    const at::Tensor src = w.stride(1) == 1 ? w : w.contiguous();
    void* stream = c10::cuda::getCurrentCUDAStream(w.device().index()).stream();
    if (b.scaling == Scaling::kTensor) {
      const at::Tensor partial = at::empty({cuda::kFp8TensorParts}, w.options().dtype(at::kFloat));
      cuda::quantize_tensor_fp8(cuda::kernel_dtype(t), src.data_ptr(), src.size(0), b.q_storage.size(0), src.size(1),
                                src.stride(0), b.q_storage.data_ptr(), b.q_storage.size(1), partial.data_ptr<float>(),
                                b.scale_storage.data_ptr<float>(), stream);
    } else if (b.scaling == Scaling::kChannel)
      cuda::quantize_rows_fp8(cuda::kernel_dtype(t), src.data_ptr(), src.size(0), b.q_storage.size(0), src.size(1),
                              src.stride(0), b.q_storage.data_ptr(), b.q_storage.size(1),
                              b.scale_storage.data_ptr<float>(), stream);
    else
      cuda::quantize_tiles_fp8(cuda::kernel_dtype(t), src.data_ptr(), src.size(0), src.size(1), src.stride(0),
                               b.q_storage.size(0), b.q_storage.size(1), cuda::Fp8Tiles::kTile, b.q_storage.data_ptr(),
                               b.q_storage.size(1), b.scale_storage.data_ptr<float>(), b.scale_storage.size(1), stream);
    return;
  }
#endif
  if (b.scaling == Scaling::kTensor) {
    // The whole weight's largest magnitude, then its codes, a few thousand rows at a time.
    const int64_t n = w.size(0), k = w.size(1);
    b.q_storage.zero_();  // the padding (after a sleep's drop its contents are lost)
    const int64_t step = std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, k));
    at::Tensor amax = at::zeros({}, w.options().dtype(at::kFloat));
    for (int64_t i = 0; i < n; i += step)
      amax = at::maximum(amax, w.narrow(0, i, std::min(n - i, step)).to(at::kFloat).abs().amax());
    const at::Tensor scale = scale_of(amax);
    for (int64_t i = 0; i < n; i += step) {
      const int64_t rows = std::min(n - i, step);
      b.q.narrow(0, i, rows).copy_((w.narrow(0, i, rows).to(at::kFloat) / scale).to(at::kFloat8_e4m3fn));
    }
    b.scale.copy_(scale);
    return;
  }
  if (b.scaling == Scaling::kChannel) {
    // The padding (after a sleep's drop its contents are lost): zeros, scale 1.
    const int64_t n = w.size(0), k = w.size(1);
    if (b.q_storage.size(1) > k) b.q_storage.narrow(1, k, b.q_storage.size(1) - k).zero_();
    if (b.q_storage.size(0) > n) {
      b.q_storage.narrow(0, n, b.q_storage.size(0) - n).zero_();
      b.scale_storage.narrow(0, n, b.scale_storage.size(0) - n).fill_(1);
    }
    const int64_t step = std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, k));
    for (int64_t i = 0; i < n; i += step) {
      const int64_t rows = std::min(n - i, step);
      const at::Tensor part = w.narrow(0, i, rows).to(at::kFloat);
      const at::Tensor scale = scale_of(part.abs().amax(1));
      b.q.narrow(0, i, rows).copy_((part / scale.unsqueeze(1)).to(at::kFloat8_e4m3fn));
      b.scale.narrow(0, i, rows).copy_(scale);
    }
    return;
  }
  const int64_t block = b.block, n = w.size(0), k = w.size(1), nb = b.scale.size(0);
  // The padding columns: zeros and scale 1 again (after a sleep's drop their contents are lost).
  const int64_t used = ceil_div(k, block);
  if (b.scale_storage.size(1) > used) {
    b.q_storage.narrow(1, used * block, b.q_storage.size(1) - used * block).zero_();
    b.scale_storage.narrow(1, used, b.scale_storage.size(1) - used).fill_(1);
  }
  const int64_t step = block_rows_per_chunk(k, block);
  for (int64_t i = 0; i < nb; i += step) {
    const int64_t rows = std::min(n - i * block, step * block), blocks = ceil_div(rows, block);
    const at::Tensor part = as_blocks(w.narrow(0, i * block, rows).to(at::kFloat), block);
    const at::Tensor scale = scale_of(part.abs().amax({1, 3}));
    const at::Tensor q = (part / scale.unsqueeze(1).unsqueeze(3)).to(at::kFloat8_e4m3fn);
    b.q_storage.narrow(0, i * block, blocks * block).narrow(1, 0, q.size(2) * block)
        .copy_(q.view({blocks * block, q.size(2) * block}));
    b.scale.narrow(0, i, blocks).copy_(scale);
  }
}

at::Tensor dequantize_weight(const QuantizedWeight& b, c10::ScalarType dtype) {
  if (b.scaling == Scaling::kChannel) return (b.q.to(at::kFloat) * b.scale.unsqueeze(1)).to(dtype);
  if (b.scaling == Scaling::kTensor) return (b.q.to(at::kFloat) * b.scale).to(dtype);
  const int64_t block = b.block;
  const at::Tensor blocks = as_blocks(b.q.to(at::kFloat), block);
  return from_blocks(blocks * b.scale.unsqueeze(1).unsqueeze(3), b.q.size(0), b.q.size(1)).to(dtype);
}

GroupQuantized quantize_groups(const at::Tensor& x, int64_t group) {
  check_size(group, "group");
  if (x.dim() < 1) throw ConfigError("fp8: activations need at least one axis");
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = x.scalar_type();
  if (group == kBlock && x.is_cuda() && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat)) {
    // The FP8 GEMM's kernel (linear()), its outputs brought to this function's layout.
    const int64_t k = x.size(-1), groups = ceil_div(k, group);
    const at::Tensor x2 = x.reshape({-1, k}).contiguous();
    const int64_t m = x2.size(0);
    const at::Tensor q = at::empty({m, groups * group}, x.options().dtype(at::kFloat8_e4m3fn));
    const at::Tensor s = at::empty({groups, std::max<int64_t>(m, 1)}, x.options().dtype(at::kFloat));
    cuda::quantize_groups_fp8(cuda::kernel_dtype(t), x2.data_ptr(), m, m, k, k, q.data_ptr(), q.size(1), groups,
                              s.data_ptr<float>(), s.size(1),
                              c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    std::vector<int64_t> scale_shape(x.sizes().begin(), x.sizes().end() - 1);
    scale_shape.push_back(groups);
    return {q.narrow(1, 0, k).contiguous().view(x.sizes()), s.narrow(1, 0, m).t().contiguous().view(scale_shape)};
  }
#endif
  const at::Tensor groups = as_groups(x.to(at::kFloat), group);
  const at::Tensor scale = scale_of(groups.abs().amax(-1));
  const at::Tensor q = (groups / scale.unsqueeze(-1)).to(at::kFloat8_e4m3fn);
  return {from_groups(q, x.size(-1)).contiguous(), scale};
}

at::Tensor dequantize_groups(const GroupQuantized& g, c10::ScalarType dtype, int64_t group) {
  check_size(group, "group");
  return from_groups(as_groups(g.q.to(at::kFloat), group) * g.scale.unsqueeze(-1), g.q.size(-1)).to(dtype);
}

namespace {

#ifdef TILLER_HAVE_CUDA_KERNELS
// Whether the GPU's activation kernels take x.
bool kernel_quantizes(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  return x.is_cuda() && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat);
}

// x [..., K] quantized by the row kernel (one scale per row: scales [...]) or the tensor kernels
// (one scale: []), as the row- and tensor-scaled GEMMs (linear()) quantize their activations.
GroupQuantized quantize_on_gpu(const at::Tensor& x, bool per_tensor) {
  const int64_t k = x.size(-1);
  if (per_tensor && x.dim() == 2 && x.stride(0) == 1 && x.stride(1) != 1 && x.size(0) > 1) {
    // A transposed view of a row-major [k, m] tensor: its transpose's codes straight from it.
    const at::Tensor src = x.t();
    const int64_t m = x.size(0), mp = round_up(m, kBlock), kp = round_up(k, kBlock);
    const at::Tensor q = at::empty({mp, kp}, x.options().dtype(at::kFloat8_e4m3fn));
    const at::Tensor s = tensor_scale(x);
    cuda::quantize_scaled_transposed_fp8(cuda::kernel_dtype(x.scalar_type()), src.data_ptr(), k, m, src.stride(0), kp,
                                         mp, q.data_ptr(), kp, s.data_ptr<float>(),
                                         c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return {q.narrow(0, 0, m).narrow(1, 0, k).contiguous(), s};
  }
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  const at::Tensor q = at::empty({m, round_up(k, 16)}, x.options().dtype(at::kFloat8_e4m3fn));
  const cuda::DType t = cuda::kernel_dtype(x.scalar_type());
  void* stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  at::Tensor s;
  if (per_tensor) {
    s = at::ones({}, x.options().dtype(at::kFloat));
    const at::Tensor partial = at::empty({cuda::kFp8TensorParts}, x.options().dtype(at::kFloat));
    cuda::quantize_tensor_fp8(t, x2.data_ptr(), m, m, k, k, q.data_ptr(), q.size(1), partial.data_ptr<float>(),
                              s.data_ptr<float>(), stream);
  } else {
    s = at::empty({m}, x.options().dtype(at::kFloat));
    cuda::quantize_rows_fp8(t, x2.data_ptr(), m, m, k, k, q.data_ptr(), q.size(1), s.data_ptr<float>(), stream);
    s = s.view(std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1));
  }
  return {q.narrow(1, 0, k).contiguous().view(x.sizes()), s};
}
#endif

}  // namespace

at::Tensor tensor_scale(const at::Tensor& x) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (kernel_quantizes(x) && x.dim() == 2 && (x.stride(1) == 1 || x.stride(0) == 1)) {
    // Row-major, or a transposed view read through its row-major source (the same largest magnitude).
    const at::Tensor src = x.stride(1) == 1 || x.size(1) <= 1 ? x : x.t();
    const at::Tensor s = at::empty({}, x.options().dtype(at::kFloat));
    const at::Tensor partial = at::empty({cuda::kFp8TensorParts}, x.options().dtype(at::kFloat));
    cuda::tensor_scale_fp8(cuda::kernel_dtype(x.scalar_type()), src.data_ptr(), src.size(0), src.size(1),
                           src.size(0) > 1 ? src.stride(0) : src.size(1), partial.data_ptr<float>(),
                           s.data_ptr<float>(), c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return s;
  }
  if (kernel_quantizes(x)) return tensor_scale(x.reshape({-1, x.size(-1)}).contiguous());
#endif
  if (x.numel() == 0) return at::ones({}, x.options().dtype(at::kFloat));
  return scale_of(x.to(at::kFloat).abs().amax());
}

GroupQuantized quantize_rows(const at::Tensor& x) {
  if (x.dim() < 1) throw ConfigError("fp8: activations need at least one axis");
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (kernel_quantizes(x)) return quantize_on_gpu(x, /*per_tensor=*/false);
#endif
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor scale = scale_of(xf.abs().amax(-1));
  return {(xf / scale.unsqueeze(-1)).to(at::kFloat8_e4m3fn), scale};
}

at::Tensor dequantize_rows(const GroupQuantized& g, c10::ScalarType dtype) {
  return (g.q.to(at::kFloat) * g.scale.unsqueeze(-1)).to(dtype);
}

GroupQuantized quantize_tensor(const at::Tensor& x) {
  if (x.dim() < 1) throw ConfigError("fp8: activations need at least one axis");
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (kernel_quantizes(x)) return quantize_on_gpu(x, /*per_tensor=*/true);
#endif
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor scale = scale_of(xf.abs().amax());
  return {(xf / scale).to(at::kFloat8_e4m3fn), scale};
}

at::Tensor dequantize_tensor(const GroupQuantized& g, c10::ScalarType dtype) {
  return (g.q.to(at::kFloat) * g.scale).to(dtype);
}

at::Tensor linear_emulated(const at::Tensor& x, const QuantizedWeight& w, const at::Tensor& bias) {
  if (x.size(-1) != w.q.size(1))
    throw ConfigError(fmt::format("fp8: x has {} features and the weight {}", x.size(-1), w.q.size(1)));
  if (w.scaling == Scaling::kTensor) return tensor_scaled_linear(x, w, bias, /*emulate=*/true);
  const at::Tensor xd = w.scaling == Scaling::kChannel ? dequantize_rows(quantize_rows(x), at::kFloat)
                                                       : dequantize_groups(quantize_groups(x, w.block), at::kFloat, w.block);
  at::Tensor y = at::matmul(xd, dequantize_weight(w, at::kFloat).t());
  if (bias.defined()) y = y + bias.to(at::kFloat);
  return y.to(x.scalar_type());
}

bool tensor_cores(const at::Device& device) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (!device.is_cuda()) return false;
  const int index = device.has_index() ? device.index() : at::cuda::current_device();
  return at::cuda::getDeviceProperties(index)->major == 9;
#else
  (void)device;
  return false;
#endif
}

at::Tensor linear(const at::Tensor& x, const QuantizedWeight& w, const at::Tensor& bias) {
  if (w.scaling == Scaling::kTensor)  // per-token activations, the GEMM tensor-wise (model/fp8_rows.h)
    return tensor_scaled_linear(x, w, bias, /*emulate=*/!(x.is_cuda() && tensor_cores(x.device())));
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = x.scalar_type();
  // The row-scaled GEMM writes bf16 only; the block-scaled one takes 128 blocks.
  const bool any_out = t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
  const bool kernel_takes = w.scaling == Scaling::kChannel ? t == at::kBFloat16 : w.block == kBlock && any_out;
  if (kernel_takes && x.is_cuda() && tensor_cores(x.device())) {
    if (x.size(-1) != w.q.size(1))
      throw ConfigError(fmt::format("fp8: x has {} features and the weight {}", x.size(-1), w.q.size(1)));
    const int64_t k = x.size(-1), n = w.q.size(0), kp = w.q_storage.size(1);
    const at::Tensor x2 = x.reshape({-1, k});
    const int64_t m = x2.size(0);
    std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
    out_shape.push_back(n);
    if (m == 0) return at::empty(out_shape, x.options());
    const at::Tensor xs = x2.stride(1) == 1 ? x2 : x2.contiguous();
    // Activations: [mp, kp] e4m3, zeros past k and past m (cuBLASLt takes whole 16-row tiles here).
    const int64_t mp = round_up(m, 16);
    const at::Tensor q = at::empty({mp, kp}, x.options().dtype(at::kFloat8_e4m3fn));
    void* stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
    at::Tensor scale_a, scale_b;
    if (w.scaling == Scaling::kChannel) {
      // One scale per row: [mp, 1] and the weight's [1, Np] (rowwise scaling).
      const at::Tensor s = at::empty({mp, 1}, x.options().dtype(at::kFloat));
      cuda::quantize_rows_fp8(cuda::kernel_dtype(t), xs.data_ptr(), m, mp, k, xs.stride(0), q.data_ptr(), kp,
                              s.data_ptr<float>(), stream);
      scale_a = s;
      scale_b = w.scale_storage.view({1, -1});
    } else {
      // Scales group-major, [groups, mp], seen as [mp, groups] (the 1x128 layout).
      const int64_t groups = kp / kBlock;
      const at::Tensor s = at::empty({groups, mp}, x.options().dtype(at::kFloat));
      cuda::quantize_groups_fp8(cuda::kernel_dtype(t), xs.data_ptr(), m, mp, k, xs.stride(0), q.data_ptr(), kp,
                                groups, s.data_ptr<float>(), mp, stream);
      scale_a = s.t();
      scale_b = w.scale_storage.t();
    }
    const at::Tensor b = bias.defined() && bias.scalar_type() != t ? bias.to(t) : bias;
    const bool padded_n = w.q_storage.size(0) != n;
    at::Tensor y = at::_scaled_mm(q, w.q_storage.t(), scale_a, scale_b,
                                  padded_n || !b.defined() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(b),
                                  std::nullopt, t);
    if (mp != m) y = y.narrow(0, 0, m);
    if (padded_n) {
      y = y.narrow(1, 0, n);
      y = b.defined() ? y + b : y.contiguous();
    }
    return y.view(out_shape);
  }
#endif
  return linear_emulated(x, w, bias);
}

namespace {

// An operand of scaled_product as a dense [rows, k] tensor, quantized and dequantized to fp32
// (`known`: a tensor-scaled operand's scale, as tensor_scale(x) gives it).
at::Tensor emulated_operand(const at::Tensor& x, Operand o, const at::Tensor& known) {
  if (o == Operand::kTensor && known.defined()) {
    const at::Tensor s = known.to(x.device(), at::kFloat);
    return (x.to(at::kFloat) / s).to(at::kFloat8_e4m3fn).to(at::kFloat) * s;
  }
  switch (o) {
    case Operand::kRows: return dequantize_rows(quantize_rows(x), at::kFloat);
    case Operand::kGroups: return dequantize_groups(quantize_groups(x), at::kFloat);
    case Operand::kBlocks: return dequantize_weight(quantize_blocks(x), at::kFloat);
    case Operand::kTensor: return dequantize_tensor(quantize_tensor(x), at::kFloat);
  }
  return {};
}

#ifdef TILLER_HAVE_CUDA_KERNELS
// x [rows, k]'s layout for the kernels: row-major (stride 1 along k), or a transposed view of a
// row-major tensor (stride 1 along rows).
bool row_major(const at::Tensor& x) { return x.stride(1) == 1 || x.size(1) <= 1; }
bool transposed_view(const at::Tensor& x) { return !row_major(x) && (x.stride(0) == 1 || x.size(0) <= 1); }

// One operand of the tensor-core product: codes [rows_p, kp] and the scales as _scaled_mm takes
// them (`as_b`: the second operand's layout).
struct DeviceOperand {
  at::Tensor q, scale;
};
DeviceOperand device_operand(at::Tensor x, Operand o, int64_t rows_p, int64_t kp, bool as_b, const at::Tensor& known,
                             void* stream) {
  const int64_t rows = x.size(0), k = x.size(1);
  const auto dt = cuda::kernel_dtype(x.scalar_type());
  const auto f8 = x.options().dtype(at::kFloat8_e4m3fn);
  const auto f32 = x.options().dtype(at::kFloat);
  DeviceOperand d;
  d.q = at::empty({rows_p, kp}, f8);
  if (o == Operand::kTensor) {
    // One scale ([]: _scaled_mm's tensor-wise form), given or found now; a transposed view by
    // tiles, from its source.
    if (!row_major(x) && !transposed_view(x)) x = x.contiguous();
    d.scale = known.defined() ? known.to(f32) : tensor_scale(x);
    if (transposed_view(x)) {
      const at::Tensor src = x.t();  // [k, rows], row-major
      cuda::quantize_scaled_transposed_fp8(dt, src.data_ptr(), k, rows, src.stride(0), kp, rows_p, d.q.data_ptr(), kp,
                                           d.scale.data_ptr<float>(), stream);
    } else {
      cuda::quantize_scaled_fp8(dt, x.data_ptr(), rows, rows_p, k, x.stride(0), d.q.data_ptr(), kp,
                                d.scale.data_ptr<float>(), stream);
    }
    return d;
  }
  if (o == Operand::kRows) {
    if (!row_major(x)) x = x.contiguous();
    const at::Tensor s = at::empty({rows_p}, f32);
    cuda::quantize_rows_fp8(dt, x.data_ptr(), rows, rows_p, k, x.stride(0), d.q.data_ptr(), kp, s.data_ptr<float>(),
                            stream);
    d.scale = as_b ? s.view({1, rows_p}) : s.view({rows_p, 1});
    return d;
  }
  if (o == Operand::kGroups) {
    // Group-major scales [kp / 128, rows_p]: the 1x128 layout (seen transposed for the first operand).
    const at::Tensor s = at::empty({kp / kBlock, rows_p}, f32);
    if (transposed_view(x)) {
      const at::Tensor src = x.t();  // [k, rows], row-major
      cuda::quantize_tiles_fp8(dt, src.data_ptr(), k, rows, src.stride(0), kp, rows_p,
                               cuda::Fp8Tiles::kColumnsTransposed, d.q.data_ptr(), kp, s.data_ptr<float>(), rows_p,
                               stream);
    } else {
      if (!row_major(x)) x = x.contiguous();
      cuda::quantize_groups_fp8(dt, x.data_ptr(), rows, rows_p, k, x.stride(0), d.q.data_ptr(), kp, kp / kBlock,
                                s.data_ptr<float>(), rows_p, stream);
    }
    d.scale = as_b ? s : s.t();
    return d;
  }
  // Blocks [rows_p / 128, kp / 128], seen transposed (the second operand's 128x128 layout).
  TILLER_CHECK(as_b, "fp8: 128x128 blocks are the second operand's scaling");
  const at::Tensor s = at::empty({rows_p / kBlock, kp / kBlock}, f32);
  if (transposed_view(x)) {
    const at::Tensor src = x.t();
    cuda::quantize_tiles_fp8(dt, src.data_ptr(), k, rows, src.stride(0), kp, rows_p, cuda::Fp8Tiles::kTileTransposed,
                             d.q.data_ptr(), kp, s.data_ptr<float>(), kp / kBlock, stream);
  } else {
    if (!row_major(x)) x = x.contiguous();
    cuda::quantize_tiles_fp8(dt, x.data_ptr(), rows, k, x.stride(0), rows_p, kp, cuda::Fp8Tiles::kTile,
                             d.q.data_ptr(), kp, s.data_ptr<float>(), kp / kBlock, stream);
  }
  d.scale = s.t();
  return d;
}

// The tensor-core product of quantized operands a [>= m, kp] and b [>= n, kp] (codes and scales
// as _scaled_mm takes them) plus `bias` [n], as [m, n] in `out`. `fast`: cuBLASLt's fast
// accumulation (tensor scaling's forward; docs/training.md).
at::Tensor tensor_core_product(const at::Tensor& qa, const at::Tensor& sa, const at::Tensor& qb, const at::Tensor& sb,
                               int64_t m, int64_t n, const at::Tensor& bias, c10::ScalarType out, bool fast = false) {
  const bool epilogue_bias = bias.defined() && qb.size(0) == n;
  at::Tensor y = at::_scaled_mm(qa, qb.t(), sa, sb,
                                epilogue_bias ? std::optional<at::Tensor>(bias.to(out)) : std::nullopt, std::nullopt,
                                out, fast);
  if (qa.size(0) != m) y = y.narrow(0, 0, m);
  if (qb.size(0) != n) y = y.narrow(1, 0, n);
  if (bias.defined() && !epilogue_bias) y = y + bias.to(out);
  return y.contiguous();
}

void* current_stream(const at::Tensor& x) { return c10::cuda::getCurrentCUDAStream(x.device().index()).stream(); }

// x [rows, k] (row-major)'s codes with the tensor scale s: x's [round_up(rows, 16), kp] (kp a
// multiple of 16, at least k) and, with `transposed`, x^T's [round_up(k, 128), round_up(rows, 128)]
// from the same read; `direct` off: x^T's alone.
struct TensorCodes {
  at::Tensor q, q_t;
};
TensorCodes tensor_codes(const at::Tensor& x, const at::Tensor& s, int64_t kp, bool direct, bool transposed) {
  const int64_t rows = x.size(0), k = x.size(1);
  const auto f8 = x.options().dtype(at::kFloat8_e4m3fn);
  const auto dt = cuda::kernel_dtype(x.scalar_type());
  const int64_t stride = rows > 1 ? x.stride(0) : k;
  TensorCodes c;
  if (direct) c.q = at::empty({round_up(rows, 16), kp}, f8);
  if (transposed) c.q_t = at::empty({round_up(k, kBlock), round_up(rows, kBlock)}, f8);
  if (direct && transposed)
    cuda::quantize_scaled_both_fp8(dt, x.data_ptr(), rows, k, stride, c.q_t.size(1), c.q_t.size(0), c.q_t.data_ptr(),
                                   c.q_t.size(1), c.q.data_ptr(), c.q.size(0), kp, kp, s.data_ptr<float>(),
                                   current_stream(x));
  else if (direct)
    cuda::quantize_scaled_fp8(dt, x.data_ptr(), rows, c.q.size(0), k, stride, c.q.data_ptr(), kp, s.data_ptr<float>(),
                              current_stream(x));
  else if (transposed)
    cuda::quantize_scaled_transposed_fp8(dt, x.data_ptr(), rows, k, stride, c.q_t.size(1), c.q_t.size(0),
                                         c.q_t.data_ptr(), c.q_t.size(1), s.data_ptr<float>(), current_stream(x));
  return c;
}

// x [..., K] as the rows [M, K] the kernels read (a copy only where x's layout is not row-major).
at::Tensor kernel_rows(const at::Tensor& x) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  return row_major(x2) ? x2 : x2.contiguous();
}

// `in` (x's scale and codes) with x^T's codes where a weight gradient will be taken (found now if
// `in` lacks them), without them otherwise.
void keep_transposed(TrainInput& in, const at::Tensor& x, bool weight_gradient) {
  if (!weight_gradient)
    in.codes_t = at::Tensor();
  else if (!in.codes_t.defined())
    in.codes_t = tensor_codes(kernel_rows(x), in.scale, 0, false, true).q_t;
}
#endif

// Whether train_linear's tensor scaling runs on tensor cores from codes it keeps (x [..., K] and
// w [N, K] bf16 on a Hopper GPU, none of the sizes 0): the forward quantizes x once for both its
// layouts, the backward gy once for both, and x^T's codes, not x, wait for the backward.
bool tensor_training_on_gpu(const at::Tensor& x, const at::Tensor& w) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  return x.is_cuda() && w.device() == x.device() && x.scalar_type() == at::kBFloat16 &&
         w.scalar_type() == at::kBFloat16 && x.numel() > 0 && w.numel() > 0 && tensor_cores(x.device());
#else
  (void)x;
  (void)w;
  return false;
#endif
}

}  // namespace

at::Tensor scaled_product(const at::Tensor& a, const at::Tensor& b, Operand oa, Operand ob, c10::ScalarType out,
                          const at::Tensor& bias, bool emulate, const at::Tensor& scale_a, const at::Tensor& scale_b,
                          bool fast_accumulation) {
  TILLER_CHECK(a.dim() == 2 && b.dim() == 2, "fp8: a product of {}-D and {}-D operands; both are 2-D", a.dim(),
               b.dim());
  TILLER_CHECK(a.size(1) == b.size(1), "fp8: a product of [{}, {}] and [{}, {}]^T: the inner sizes differ", a.size(0),
               a.size(1), b.size(0), b.size(1));
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  TILLER_CHECK(oa != Operand::kBlocks, "fp8: 128x128 blocks are the second operand's scaling");
  TILLER_CHECK((oa == Operand::kRows) == (ob == Operand::kRows),
               "fp8: row scaling on one operand needs it on the other");
  TILLER_CHECK((oa == Operand::kTensor) == (ob == Operand::kTensor),
               "fp8: tensor scaling on one operand needs it on the other");
  TILLER_CHECK(!bias.defined() || bias.numel() == n, "fp8: a bias of {} for {} outputs", bias.numel(), n);
  TILLER_CHECK((!scale_a.defined() || (oa == Operand::kTensor && scale_a.numel() == 1)) &&
                   (!scale_b.defined() || (ob == Operand::kTensor && scale_b.numel() == 1)),
               "fp8: a known scale is one value, for a tensor-scaled operand");
  TILLER_CHECK(!fast_accumulation || oa == Operand::kTensor, "fp8: fast accumulation is for tensor-scaled products");
  if (m == 0 || n == 0 || k == 0) {
    at::Tensor y = at::zeros({m, n}, a.options().dtype(out));
    return bias.defined() ? y + bias.to(out) : y;
  }
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = a.scalar_type();
  const bool kernels_take = (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat) && b.scalar_type() == t &&
                            out == at::kBFloat16;
  if (!emulate && kernels_take && a.is_cuda() && b.device() == a.device() && tensor_cores(a.device())) {
    // Row-major or a transposed view of a row-major tensor; anything else is copied first.
    const auto as_kernels_take = [](const at::Tensor& x) {
      return row_major(x) || transposed_view(x) ? x : x.contiguous();
    };
    const at::Tensor ak = as_kernels_take(a), bk = as_kernels_take(b);
    void* stream = c10::cuda::getCurrentCUDAStream(ak.device().index()).stream();
    // The contraction to 4 blocks (the block-scaled GEMM's scale rows, quantize_blocks), to 16
    // (row and tensor scaling) or, where a tile kernel quantizes a tensor-scaled operand, to whole
    // tiles; the rows to whole 16-row tiles, or whole 128-row tiles where a tile kernel quantizes them.
    const bool tiled_tensor = oa == Operand::kTensor && (transposed_view(ak) || transposed_view(bk));
    const int64_t kp = oa == Operand::kRows || (oa == Operand::kTensor && !tiled_tensor) ? round_up(k, 16)
                       : oa == Operand::kTensor                                          ? round_up(k, kBlock)
                                                                                         : round_up(k, 4 * kBlock);
    auto padded = [&](const at::Tensor& x, Operand o) {
      return o == Operand::kBlocks || ((o == Operand::kGroups || o == Operand::kTensor) && transposed_view(x))
                 ? round_up(x.size(0), kBlock)
                 : round_up(x.size(0), 16);
    };
    const int64_t mp = padded(ak, oa), np = padded(bk, ob);
    const auto scalar = [](const at::Tensor& s) { return s.defined() ? s.reshape({}) : s; };
    const DeviceOperand qa = device_operand(ak, oa, mp, kp, false, scalar(scale_a), stream);
    const DeviceOperand qb = device_operand(bk, ob, np, kp, true, scalar(scale_b), stream);
    return tensor_core_product(qa.q, qa.scale, qb.q, qb.scale, m, n, bias, out, fast_accumulation);
  }
#endif
  (void)emulate, (void)fast_accumulation;
  at::Tensor y = at::matmul(emulated_operand(a, oa, scale_a), emulated_operand(b, ob, scale_b).t());
  if (bias.defined()) y = y + bias.to(at::kFloat);
  return y.to(out);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The operands' scalings of the forward, the input gradient and the weight gradient.
struct Recipe {
  Operand fwd_a, fwd_b, dgrad_a, dgrad_b, wgrad_a, wgrad_b;
};
Recipe recipe(Scaling s) {
  if (s == Scaling::kChannel)
    return {Operand::kRows, Operand::kRows, Operand::kRows, Operand::kRows, Operand::kRows, Operand::kRows};
  if (s == Scaling::kTensor)
    return {Operand::kTensor, Operand::kTensor, Operand::kTensor, Operand::kTensor, Operand::kTensor, Operand::kTensor};
  return {Operand::kGroups, Operand::kBlocks, Operand::kGroups, Operand::kBlocks, Operand::kGroups, Operand::kGroups};
}

// Tensor scaling on tensor cores (tensor_training_on_gpu): the forward takes x's codes from
// `in` (train_input), finds w's scale and codes, and keeps w, the two scales and x^T's codes; the
// backward finds gy's scale, quantizes gy once for both layouts and w^T from the kept scale.
at::Tensor tensor_forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          const TrainInput& in, bool fast) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  const int64_t k = x.size(-1), n = w.size(0), m = x.numel() / k;
  TILLER_CHECK(in.codes.size(0) == round_up(m, 16) && in.codes.size(1) == round_up(k, 16),
               "fp8: shared codes [{}, {}] for an input of {} rows of {}", in.codes.size(0), in.codes.size(1), m, k);
  const at::Tensor sw = tensor_scale(w);
  const DeviceOperand qw = device_operand(row_major(w) ? w : w.contiguous(), Operand::kTensor, round_up(n, 16),
                                          in.codes.size(1), true, sw, current_stream(w));
  ctx->save_for_backward({w});
  ctx->saved_data["sx"] = in.scale;
  ctx->saved_data["sw"] = sw;
  ctx->saved_data["x_sizes"] = x.sizes().vec();
  if (in.codes_t.defined()) ctx->saved_data["x_t"] = in.codes_t;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(n);
  return tensor_core_product(in.codes, in.scale, qw.q, sw, m, n, bias, x.scalar_type(), fast).view(shape);
#else
  (void)ctx, (void)x, (void)w, (void)bias, (void)in, (void)fast;
  throw std::logic_error("fp8: tensor-core training without the GPU build");
#endif
}

std::vector<at::Tensor> tensor_backward(AutogradContext* ctx, const at::Tensor& w, const at::Tensor& grad,
                                        bool need_gx, bool need_gw) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
  const int64_t k = w.size(1), n = w.size(0);
  const at::Tensor gy = kernel_rows(grad);  // [M, N]
  const int64_t m = gy.size(0);
  const at::Tensor sg = tensor_scale(gy), sw = ctx->saved_data["sw"].toTensor();
  // gy's codes for dgrad (its contraction N padded to w^T's tiles) and gy^T's for wgrad, one read.
  const TensorCodes g = tensor_codes(gy, sg, round_up(n, kBlock), need_gx, need_gw);
  at::Tensor gx, gw;
  if (need_gx) {
    const DeviceOperand qwt = device_operand(w.t(), Operand::kTensor, round_up(k, kBlock), round_up(n, kBlock), true,
                                             sw, current_stream(w));
    gx = tensor_core_product(g.q, sg, qwt.q, sw, m, k, {}, grad.scalar_type()).view(x_sizes);
  }
  if (need_gw) {
    TILLER_CHECK(ctx->saved_data.count("x_t") > 0,
                 "fp8: a weight gradient of a linear whose forward ran without one in view (x^T's codes not kept)");
    gw = tensor_core_product(g.q_t, sg, ctx->saved_data["x_t"].toTensor(), ctx->saved_data["sx"].toTensor(), n, k,
                             {}, w.scalar_type());
  }
  return {gx, gw, gy};
#else
  (void)ctx, (void)w, (void)grad, (void)need_gx, (void)need_gw;
  throw std::logic_error("fp8: tensor-core training without the GPU build");
#endif
}

struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  // `bias`: empty ([0]) for none (autograd takes no undefined inputs). `shared`: x's codes for
  // tensor scaling on tensor cores (train_input), or null for the other paths. `fast`: the
  // forward's fast accumulation (tensor scaling on tensor cores).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias_in,
                            int64_t scaling, const TrainInput* shared, bool fast) {
    const at::Tensor bias = bias_in.numel() > 0 ? bias_in : at::Tensor();
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["bias"] = bias.defined();
    ctx->saved_data["tensor_cores"] = shared != nullptr;
    if (shared) return tensor_forward(ctx, x, w, bias, *shared, fast);
    ctx->save_for_backward({x, w});
    const Recipe r = recipe(static_cast<Scaling>(scaling));
    const int64_t k = x.size(-1), n = w.size(0);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(n);
    const at::Tensor x2 = x.reshape({-1, k});
    if (static_cast<Scaling>(scaling) == Scaling::kTensor) {
      // x's and w's scales, found once: the backward's x^T and w^T take them again.
      const at::Tensor sx = tensor_scale(x2), sw = tensor_scale(w);
      ctx->saved_data["sx"] = sx;
      ctx->saved_data["sw"] = sw;
      return scaled_product(x2, w, r.fwd_a, r.fwd_b, x.scalar_type(), bias, false, sx, sw, fast).view(shape);
    }
    return scaled_product(x2, w, r.fwd_a, r.fwd_b, x.scalar_type(), bias).view(shape);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2);
    if (ctx->saved_data["tensor_cores"].toBool()) {
      const auto g = tensor_backward(ctx, saved[0], grads[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
      const at::Tensor gb = has_bias ? g[2].sum(0, false, at::kFloat).to(g[2].scalar_type()) : at::Tensor();
      return {g[0], g[1], gb, at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const Recipe r = recipe(static_cast<Scaling>(ctx->saved_data["scaling"].toInt()));
    const int64_t k = x.size(-1), n = w.size(0);
    const at::Tensor x2 = x.reshape({-1, k});
    const at::Tensor gy = grads[0].reshape({-1, n});
    at::Tensor gx, gw, gb;
    // Tensor scaling: gy's scale once for both products, x's and w's from the forward.
    at::Tensor sg, sx, sw;
    if (static_cast<Scaling>(ctx->saved_data["scaling"].toInt()) == Scaling::kTensor) {
      sg = tensor_scale(gy);
      sx = ctx->saved_data["sx"].toTensor();
      sw = ctx->saved_data["sw"].toTensor();
    }
    if (ctx->needs_input_grad(0))
      gx = scaled_product(gy, w.t(), r.dgrad_a, r.dgrad_b, x.scalar_type(), {}, false, sg, sw).view(x.sizes());
    if (ctx->needs_input_grad(1))
      gw = scaled_product(gy.t(), x2.t(), r.wgrad_a, r.wgrad_b, w.scalar_type(), {}, false, sg, sx);
    if (has_bias) gb = gy.sum(0, false, at::kFloat).to(gy.scalar_type());
    return {gx, gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// train_swiglu's node: x [.., K] by w_gate and w_up [N, K] into gate and up (kept for the
// backward, as swiglu keeps them), act = silu(gate) * up with its scale (a second output, not
// differentiable).
struct Fp8SwiGlu : public torch::autograd::Function<Fp8SwiGlu> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                               const TrainInput* in, bool fast) {
#ifdef TILLER_HAVE_CUDA_KERNELS
    const int64_t k = x.size(-1), n = wg.size(0), m = x.numel() / k, kp = in->codes.size(1);
    TILLER_CHECK(in->codes.size(0) == round_up(m, 16) && kp == round_up(k, 16),
                 "fp8: shared codes [{}, {}] for an input of {} rows of {}", in->codes.size(0), kp, m, k);
    void* stream = current_stream(x);
    const auto project = [&](const at::Tensor& w, const at::Tensor& sw) {
      const DeviceOperand q = device_operand(row_major(w) ? w : w.contiguous(), Operand::kTensor, round_up(n, 16), kp,
                                             true, sw, stream);
      return tensor_core_product(in->codes, in->scale, q.q, sw, m, n, {}, x.scalar_type(), fast);
    };
    const at::Tensor swg = tensor_scale(wg), swu = tensor_scale(wu);
    const at::Tensor gate = project(wg, swg), up = project(wu, swu);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(n);
    at::Tensor act = at::empty(shape, gate.options());
    const at::Tensor scale = at::empty({}, gate.options().dtype(at::kFloat));
    const at::Tensor partial = at::empty({cuda::kFp8TensorParts}, scale.options());
    cuda::swiglu(cuda::kernel_dtype(gate.scalar_type()), gate.data_ptr(), n, up.data_ptr(), n, act.data_ptr(), m, n,
                 stream, partial.data_ptr<float>(), scale.data_ptr<float>());
    ctx->save_for_backward({wg, wu, gate, up});
    ctx->saved_data["sx"] = in->scale;
    ctx->saved_data["swg"] = swg;
    ctx->saved_data["swu"] = swu;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    if (in->codes_t.defined()) ctx->saved_data["x_t"] = in->codes_t;
    ctx->mark_non_differentiable({scale});
    return {act, scale};
#else
    (void)ctx, (void)x, (void)wg, (void)wu, (void)in, (void)fast;
    throw std::logic_error("fp8: tensor-core training without the GPU build");
#endif
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
#ifdef TILLER_HAVE_CUDA_KERNELS
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &wg = saved[0], &wu = saved[1], &gate = saved[2], &up = saved[3];
    const int64_t m = gate.size(0), n = gate.size(1), k = wg.size(1);
    const at::Tensor d = grads[0].reshape({m, n}).contiguous();
    void* stream = current_stream(d);
    // silu's backward with the scales of both input gradients.
    at::Tensor dg = at::empty({m, n}, gate.options()), du = at::empty({m, n}, gate.options());
    // Each scale a tensor of its own (cuBLASLt refuses a scale 4 bytes into an allocation).
    const at::Tensor scales[2] = {at::empty({}, gate.options().dtype(at::kFloat)),
                                  at::empty({}, gate.options().dtype(at::kFloat))};
    const at::Tensor partial = at::empty({2 * cuda::kFp8TensorParts}, scales[0].options());
    cuda::swiglu_backward(cuda::kernel_dtype(gate.scalar_type()), gate.data_ptr(), up.data_ptr(), d.data_ptr(),
                          dg.data_ptr(), du.data_ptr(), m, n, stream, partial.data_ptr<float>(),
                          scales[0].data_ptr<float>(), scales[1].data_ptr<float>());
    const bool need_gx = ctx->needs_input_grad(0);
    at::Tensor gx, gw[2];
    const at::Tensor* ws[2] = {&wg, &wu};
    const at::Tensor gys[2] = {dg, du};
    const char* sw_keys[2] = {"swg", "swu"};
    for (int i = 0; i < 2; ++i) {
      const bool need_gw = ctx->needs_input_grad(1 + i);
      const at::Tensor& sg = scales[i];
      const at::Tensor sw = ctx->saved_data[sw_keys[i]].toTensor();
      const TensorCodes g = tensor_codes(gys[i], sg, round_up(n, kBlock), need_gx, need_gw);
      if (need_gx) {
        const DeviceOperand qwt = device_operand(ws[i]->t(), Operand::kTensor, round_up(k, kBlock),
                                                 round_up(n, kBlock), true, sw, stream);
        const at::Tensor part = tensor_core_product(g.q, sg, qwt.q, sw, m, k, {}, gate.scalar_type());
        if (gx.defined())
          gx.add_(part);  // gx is this node's own tensor: the sum in place, the same bf16 values
        else
          gx = part;
      }
      if (need_gw) {
        TILLER_CHECK(ctx->saved_data.count("x_t") > 0,
                     "fp8: a weight gradient of a SwiGLU projection whose forward ran without one in view");
        gw[i] = tensor_core_product(g.q_t, sg, ctx->saved_data["x_t"].toTensor(), ctx->saved_data["sx"].toTensor(),
                                    n, k, {}, ws[i]->scalar_type());
      }
    }
    if (gx.defined()) gx = gx.view(ctx->saved_data["x_sizes"].toIntVector());
    return {gx, gw[0], gw[1], at::Tensor(), at::Tensor()};
#else
    (void)ctx, (void)grads;
    throw std::logic_error("fp8: tensor-core training without the GPU build");
#endif
  }
};

}  // namespace

at::Tensor train_swiglu(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up, const TrainInput& in,
                        TrainInput& act_in, bool down_weight_gradient, bool fast_accumulation) {
  act_in = {};
  if (!in.defined() || !tensor_training_on_gpu(x, w_gate) || !tensor_training_on_gpu(x, w_up) ||
      w_gate.sizes() != w_up.sizes() || w_gate.size(1) != x.size(-1))
    return {};
#ifdef TILLER_HAVE_CUDA_KERNELS
  TrainInput own = in;
  keep_transposed(own, x, c10::GradMode::is_enabled() && (w_gate.requires_grad() || w_up.requires_grad()));
  const variable_list out = Fp8SwiGlu::apply(x, w_gate, w_up, static_cast<const TrainInput*>(&own), fast_accumulation);
  // The down projection's input: the product's codes for the scale its kernel found.
  const at::Tensor act2 = kernel_rows(out[0]);
  act_in.scale = out[1];
  TensorCodes c = tensor_codes(act2, act_in.scale, round_up(act2.size(1), 16), true,
                               down_weight_gradient && c10::GradMode::is_enabled());
  act_in.codes = std::move(c.q);
  act_in.codes_t = std::move(c.q_t);
  return out[0];
#else
  (void)down_weight_gradient, (void)fast_accumulation;
  return {};
#endif
}

TrainInput train_input(const at::Tensor& x, Scaling scaling, bool weight_gradients) {
  TrainInput in;
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (scaling != Scaling::kTensor || x.dim() < 1 || !x.is_cuda() || x.scalar_type() != at::kBFloat16 ||
      x.numel() == 0 || !tensor_cores(x.device()))
    return in;
  const at::Tensor x2 = kernel_rows(x);
  in.scale = tensor_scale(x2);
  TensorCodes c = tensor_codes(x2, in.scale, round_up(x2.size(1), 16), true, weight_gradients);
  in.codes = std::move(c.q);
  in.codes_t = std::move(c.q_t);
#else
  (void)x, (void)scaling, (void)weight_gradients;
#endif
  return in;
}

at::Tensor train_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Scaling scaling,
                        const TrainInput& shared, bool fast_accumulation) {
  if (x.size(-1) != w.size(1))
    throw ConfigError(fmt::format("fp8: x has {} features and the weight {}", x.size(-1), w.size(1)));
  const at::Tensor b = bias.defined() ? bias : at::empty({0}, w.options());
  // Fast accumulation is tensor scaling's on tensor cores; the other paths accumulate in fp32.
  const bool fast = fast_accumulation && scaling == Scaling::kTensor && x.is_cuda() && tensor_cores(x.device());
  if (scaling != Scaling::kTensor || !tensor_training_on_gpu(x, w))
    return Fp8Linear::apply(x, w, b, static_cast<int64_t>(scaling), static_cast<const TrainInput*>(nullptr), fast);
#ifdef TILLER_HAVE_CUDA_KERNELS
  // x's codes (and x^T's, where this weight's gradient will be taken) from `shared` or found now.
  const bool weight_gradient = c10::GradMode::is_enabled() && w.requires_grad();
  TrainInput in = shared.defined() ? shared : train_input(x, scaling, weight_gradient);
  keep_transposed(in, x, weight_gradient);
  return Fp8Linear::apply(x, w, b, static_cast<int64_t>(scaling), static_cast<const TrainInput*>(&in), fast);
#else
  (void)shared;
  return Fp8Linear::apply(x, w, b, static_cast<int64_t>(scaling), static_cast<const TrainInput*>(nullptr), fast);
#endif
}

at::Tensor train_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Scaling scaling,
                        bool fast_accumulation) {
  return train_linear(x, w, bias, scaling, TrainInput{}, fast_accumulation);
}

}  // namespace tiller::model::fp8
