// Tensor scaling's per-token activations (model/fp8_rows.h).
#include "model/fp8_rows.h"

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "model/cuda/aten_dtype.h"
#endif

#include "tiller/core/error.h"
#include "tiller/model/numerics.h"
#include "tiller/model/transformer.h"

namespace tiller::model::fp8 {
namespace {

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

bool kernel_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; }

// Codes and scales for `rows` rows of `k` values, padded as RowCodes says (filled by the caller).
RowCodes empty_codes(int64_t rows, int64_t k, const at::TensorOptions& o) {
  RowCodes c;
  c.rows = rows;
  c.k = k;
  const int64_t mp = round_up(rows, 16);
  c.q = at::empty({mp, round_up(k, 16)}, o.dtype(at::kFloat8_e4m3fn));
  c.scale = at::empty({mp}, o.dtype(at::kFloat));
  return c;
}

#ifdef TILLER_HAVE_CUDA_KERNELS
void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

}  // namespace

RowCodes quantize_row_codes(const at::Tensor& x) {
  TILLER_CHECK(x.dim() == 2 && x.stride(1) == 1, "fp8: row codes take [rows, k] activations with unit inner stride");
  const int64_t m = x.size(0), k = x.size(1);
  RowCodes c = empty_codes(m, k, x.options());
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (x.is_cuda() && kernel_type(x.scalar_type())) {
    cuda::quantize_rows_fp8(cuda::kernel_dtype(x.scalar_type()), x.data_ptr(), m, c.q.size(0), k, x.stride(0),
                            c.q.data_ptr(), c.q.size(1), c.scale.data_ptr<float>(), stream_of(x));
    return c;
  }
#endif
  const GroupQuantized g = quantize_rows(x);
  c.q.zero_();
  c.q.narrow(0, 0, m).narrow(1, 0, k).copy_(g.q);
  c.scale.fill_(1);
  c.scale.narrow(0, 0, m).copy_(g.scale);
  return c;
}

at::Tensor unscaled_product(const RowCodes& a, const QuantizedWeight& w, at::ScalarType dtype, bool emulate) {
  TILLER_CHECK(w.scaling == Scaling::kTensor, "fp8: an unscaled product takes a tensor-scaled weight");
  if (a.k != w.q.size(1))
    throw ConfigError(fmt::format("fp8: x has {} features and the weight {}", a.k, w.q.size(1)));
  const int64_t n = w.q.size(0);
  if (!emulate && a.q.is_cuda() && tensor_cores(a.q.device()) && kernel_type(dtype)) {
    at::Tensor y = at::_scaled_mm(a.q, w.q_storage.t(), unit_scale(a.q.device()), w.scale_storage, std::nullopt,
                                  std::nullopt, dtype);
    y = y.narrow(0, 0, a.rows);
    return y.size(1) == n ? y : y.narrow(1, 0, n).contiguous();
  }
  const at::Tensor codes = a.q.narrow(0, 0, a.rows).narrow(1, 0, a.k).to(at::kFloat);
  return at::matmul(codes, dequantize_weight(w, at::kFloat).to(codes.device()).t()).to(dtype);
}

void scale_rows_(const at::Tensor& y, const at::Tensor& scale, const at::Tensor& bias) {
  TILLER_CHECK(y.dim() == 2 && y.stride(1) == 1 && scale.dim() == 1 && scale.size(0) >= y.size(0) &&
                   scale.scalar_type() == at::kFloat && (!bias.defined() || bias.numel() == y.size(1)),
               "fp8: scale_rows_ takes y [rows, n], fp32 scales for its rows and an optional bias [n]");
  const at::Tensor b = bias.defined() && bias.scalar_type() != y.scalar_type() ? bias.to(y.scalar_type()) : bias;
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (y.is_cuda() && kernel_type(y.scalar_type()) && scale.is_contiguous()) {
    const at::Tensor bc = b.defined() ? b.contiguous() : b;
    cuda::scale_rows(cuda::kernel_dtype(y.scalar_type()), y.data_ptr(), y.size(0), y.size(1), y.stride(0),
                     scale.data_ptr<float>(), bc.defined() ? bc.data_ptr() : nullptr, stream_of(y));
    return;
  }
#endif
  at::Tensor v = y.to(at::kFloat) * scale.narrow(0, 0, y.size(0)).unsqueeze(1);
  if (b.defined()) v = v + b.to(at::kFloat);
  y.copy_(v);
}

at::Tensor tensor_scaled_linear(const at::Tensor& x, const QuantizedWeight& w, const at::Tensor& bias, bool emulate) {
  const int64_t k = x.size(-1);
  if (k != w.q.size(1)) throw ConfigError(fmt::format("fp8: x has {} features and the weight {}", k, w.q.size(1)));
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  out_shape.push_back(w.q.size(0));
  const at::Tensor x2 = x.reshape({-1, k});
  if (x2.size(0) == 0) return at::empty(out_shape, x.options());
  const RowCodes a = quantize_row_codes(x2.stride(1) == 1 ? x2 : x2.contiguous());
  at::Tensor y = unscaled_product(a, w, x.scalar_type(), emulate);
  scale_rows_(y, a.scale, bias);
  return y.view(out_shape);
}

RowCodes add_rms_norm_codes(at::Tensor& x, const at::Tensor& add, const at::Tensor& add_scale,
                            const at::Tensor& weight, double eps) {
  TILLER_CHECK(x.dim() == 2 && add.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                   (!add_scale.defined() || (add_scale.dim() == 1 && add_scale.size(0) >= x.size(0) &&
                                             add_scale.scalar_type() == at::kFloat)),
               "fp8: add_rms_norm_codes wants x, add [T, width], weight [width] and fp32 row scales");
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = x.scalar_type();
  if (x.is_cuda() && !batch_invariant() && kernel_type(t) && x.stride(1) == 1 && add.stride(1) == 1 &&
      add.scalar_type() == t && weight.scalar_type() == t && weight.is_contiguous() &&
      (!add_scale.defined() || add_scale.is_contiguous())) {
    RowCodes c = empty_codes(x.size(0), x.size(1), x.options());
    cuda::add_rms_norm_fp8(cuda::kernel_dtype(t), x.data_ptr(), add.data_ptr(),
                           add_scale.defined() ? add_scale.data_ptr<float>() : nullptr, weight.data_ptr(), c.rows,
                           c.q.size(0), x.size(1), x.stride(0), add.stride(0), c.q.data_ptr(), c.q.size(1),
                           c.scale.data_ptr<float>(), static_cast<float>(eps), stream_of(x));
    return c;
  }
#endif
  at::Tensor a = add;
  if (add_scale.defined()) {
    a = add.clone();
    scale_rows_(a, add_scale);
  }
  return quantize_row_codes(add_rms_norm(x, a, weight, eps));
}

RowCodes swiglu_codes(const at::Tensor& gate_up, const at::Tensor& scale) {
  TILLER_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1 && scale.dim() == 1 &&
                   scale.size(0) >= gate_up.size(0) && scale.scalar_type() == at::kFloat,
               "fp8: swiglu_codes wants gate/up [T, 2 width] and fp32 row scales");
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = gate_up.scalar_type();
  if (gate_up.is_cuda() && !batch_invariant() && kernel_type(t) && scale.is_contiguous() &&
      gate_up.size(1) / 2 * gate_up.element_size() <= cuda::kSwigluFp8MaxBytes) {
    RowCodes c = empty_codes(gate_up.size(0), gate_up.size(1) / 2, gate_up.options());
    cuda::swiglu_fp8(cuda::kernel_dtype(t), gate_up.data_ptr(), gate_up.stride(0), scale.data_ptr<float>(), c.rows,
                     c.q.size(0), c.k, c.q.data_ptr(), c.q.size(1), c.scale.data_ptr<float>(), stream_of(gate_up));
    return c;
  }
#endif
  const at::Tensor g = gate_up.clone();
  scale_rows_(g, scale);
  return quantize_row_codes(swiglu_packed(g));
}

const at::Tensor& unit_scale(const at::Device& device) {
  static std::mutex mu;
  // Never freed: a CUDA tensor's destructor at exit could run after the CUDA runtime's teardown.
  static auto* units = new std::map<std::string, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mu);
  const std::string key = device.str();
  auto it = units->find(key);
  if (it == units->end()) {
#ifdef TILLER_HAVE_CUDA_KERNELS
    if (device.is_cuda()) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      const cudaError_t err = cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status);
      TILLER_CHECK(err == cudaSuccess && status == cudaStreamCaptureStatusNone,
                   "fp8: the unit scale of {} is made during a CUDA graph's capture; quantize the weights first",
                   key);
    }
#endif
    it = units->emplace(key, at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device))).first;
  }
  return it->second;
}

}  // namespace tiller::model::fp8
