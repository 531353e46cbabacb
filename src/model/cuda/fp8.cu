// FP8 (e4m3) quantization of activations per token and group of 128 features (kernels.h): one
// warp per (row, group), four values per lane, the group's largest magnitude by a warp reduction.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int kGroup = 128;
constexpr int kPerLane = kGroup / 32;

template <class T>
__global__ void quantize_groups_kernel(const T* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                                       uint8_t* q, int64_t q_stride, int64_t groups, float* scale,
                                       int64_t scale_stride) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= padded_rows * groups) return;
  const int64_t r = warp / groups, g = warp % groups;
  const int64_t col = g * kGroup + lane * kPerLane;
  float v[kPerLane];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = r < rows && col + i < k ? to_f(x[r * x_stride + col + i]) : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = amax > 0.f ? amax / 448.f : 1.f;  // IEEE division, as ATen's
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(v[i] / s, __NV_SATFINITE, __NV_E4M3);
    packed |= static_cast<uint32_t>(b) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(q + r * q_stride + col) = packed;
  if (lane == 0) scale[g * scale_stride + r] = s;
}

}  // namespace

void quantize_groups_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, int64_t groups, float* scale, int64_t scale_stride, void* stream) {
  if (groups * kGroup < k || q_stride < groups * kGroup || q_stride % 4 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 4 != 0 || padded_rows < rows || scale_stride < padded_rows)
    throw std::invalid_argument("quantize_groups_fp8: q must hold whole groups in 4-byte aligned rows, and the "
                                "scales every padded row");
  const int64_t warps = padded_rows * groups;
  if (warps == 0) return;
  const int threads = 256;
  const auto blocks = static_cast<unsigned>((warps * 32 + threads - 1) / threads);
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    quantize_groups_kernel<T><<<blocks, threads, 0, s>>>(static_cast<const T*>(x), rows, padded_rows, k, x_stride,
                                                         static_cast<uint8_t*>(q), q_stride, groups, scale,
                                                         scale_stride);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("fp8 quantize kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace tiller::model::cuda
