// What every FP8 (e4m3) activation kernel shares, so that they quantize alike bit for bit: a
// row's (group's, tensor's) scale from its largest magnitude, a value's code, and a block's
// largest value. CUDA translation units only.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "model/fp8_quotient.h"

namespace tiller::model::cuda {

// amax / 448 by IEEE division (as ATen's), 1 for a block of zeros (whatever its scale, it stays zeros).
__device__ __forceinline__ float fp8_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// v / s as torch's float8_e4m3fn cast rounds it: nearest even, saturating at +-448.
__device__ __forceinline__ uint8_t fp8_code(float v, float s) {
  return __nv_cvt_float_to_fp8(v / s, __NV_SATFINITE, __NV_E4M3);
}

// fp8_code(v, s) for the many values one scale divides, through s's reciprocal where
// fp8_quotient.h shows it equal to the division (the same codes, a fraction of the instructions).
// kCorrections: 1 for values read from two-byte storage (exact for every bf16 and fp16 value), 2
// for fp32 (kQuotientCorrections<T>).
template <class T>
constexpr int kQuotientCorrections = sizeof(T) == 2 ? 1 : 2;
struct Fp8Divider {
  float s, r;
  bool reciprocal;
  __device__ explicit Fp8Divider(float scale)
      : s(scale), r(1.f / scale), reciprocal(scale >= fp8::kQuotientMinScale && scale <= fp8::kQuotientMaxScale) {}
  template <int kCorrections = 2>
  __device__ __forceinline__ float quotient(float v) const {
    // An infinite v makes the scale infinite, outside the range: it divides outright.
    return reciprocal ? fp8::quotient_by_reciprocal<kCorrections>(v, s, r) : v / s;
  }
  template <int kCorrections = 2>
  __device__ __forceinline__ uint8_t code(float v) const {
    return __nv_cvt_float_to_fp8(quotient<kCorrections>(v), __NV_SATFINITE, __NV_E4M3);
  }
  // Two codes in one conversion: a's in the low byte.
  template <int kCorrections = 2>
  __device__ __forceinline__ uint32_t code2(float a, float b) const {
    return __nv_cvt_float2_to_fp8x2(make_float2(quotient<kCorrections>(a), quotient<kCorrections>(b)), __NV_SATFINITE,
                                    __NV_E4M3);
  }
};

// The largest of a block's values of `v` (every thread's), in every thread; blockDim.x a multiple of
// 32, at most 1024. A maximum is exact, so the order of the reduction does not matter.
__device__ inline float block_max(float v) {
  __shared__ float warp_max[32];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();  // warp_max may still be read by a previous call
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x % 32] : 0.f;
  if (threadIdx.x < 32) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (threadIdx.x == 0) warp_max[0] = v;
  }
  __syncthreads();
  return warp_max[0];
}

}  // namespace tiller::model::cuda
