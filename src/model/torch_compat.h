// The one place where tiller reaches into libtorch API that differs between the versions it
// builds against (2.11 on the GPU host, 2.13 on the CPU machines). Everything else uses the API
// both share.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>

namespace tiller::compat {

// ATen's varlen flash attention (aten::_flash_attention_forward). 2.13 appends block_table and
// num_splits to the signature; both versions take the leading arguments used here, with the
// trailing ones defaulted. Returns the output [Tq, heads, head_dim]; differentiable through
// aten::_flash_attention_backward.
inline at::Tensor flash_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q,
                                         int64_t max_k, double scale, int64_t window_left) {
  std::optional<int64_t> left, right;
  if (window_left >= 0) {
    left = window_left;
    right = 0;
  }
  return std::get<0>(at::_flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, /*dropout_p=*/0.0,
                                                  /*is_causal=*/true, /*return_debug_mask=*/false, scale, left,
                                                  right));
}

}  // namespace tiller::compat

#include <ATen/DeviceAccelerator.h>

namespace tiller::compat {

// Blocks until everything queued on the device has run (CUDA: cudaDeviceSynchronize).
inline void synchronize(const at::Device& d) {
  if (!d.is_cpu()) at::accelerator::synchronizeDevice(d.index() < 0 ? 0 : d.index());
}

// Peak bytes the caching allocator handed out on `d` since the last reset; 0 on CPU.
inline int64_t peak_allocated_bytes(const at::Device& d) {
  if (d.is_cpu()) return 0;
  return at::accelerator::getDeviceStats(d.index() < 0 ? 0 : d.index()).allocated_bytes[0].peak;
}
inline void reset_peak(const at::Device& d) {
  if (!d.is_cpu()) at::accelerator::resetPeakStats(d.index() < 0 ? 0 : d.index());
}

}  // namespace tiller::compat

namespace tiller::compat {

// acc (fp32) += a @ b for a, b in acc's dtype or in bf16/fp16: on CUDA one GEMM that accumulates
// in fp32 in its epilogue (aten::addmm.dtype_out, PyTorch >= 2.8); elsewhere a product and an add.
inline void addmm_accumulate(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) {
  if (acc.is_cuda() && a.scalar_type() != acc.scalar_type()) {
    at::addmm_out(acc, acc, a, b, acc.scalar_type());
  } else {
    acc.add_(at::matmul(a, b));
  }
}

}  // namespace tiller::compat
