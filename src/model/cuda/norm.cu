// The residual add fused with the RMSNorm after it (inference): one read of the stream and the
// addend, one write of each result; or, for a tensor-scaled FP8 engine, the normed rows quantized
// (one scale per row) in the same kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/fp8_codes.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int kThreads = 256;

// One thread block per row. The row's y = T(x + a) stays in registers (up to kHeld vectors
// per thread; rows wider than kThreads * kHeld * kVec are read back from x), stored into x, and
// the sum of y^2 in fp32 gives rstd; out = T(y * rstd * weight), as ATen's rms_norm computes it.
// The addend a is add's element, or T(add * add_scale[row]) where add_scale is given (a
// tensor-scaled FP8 product before its rows' scales: scale_rows' rounding).
// kFp8: out is not stored but quantized as quantize_rows_fp8 quantizes it (one scale per row,
// fp8_codes.cuh): codes into q [gridDim.x rows, q_stride] (zeros past width; rows from `rows` on are
// padding: zeros, scale 1), the row's scale into scale[row]. The out values stay in `held`
// between the two passes (recomputed past kHeld vectors).
template <class T, int kVec, bool kFp8>
__global__ void __launch_bounds__(kThreads) add_rms_norm_kernel(T* x, const T* add, const float* add_scale,
                                                                const T* weight, T* out, int64_t rows,
                                                                int64_t width, int64_t x_stride, int64_t add_stride,
                                                                int64_t out_stride, uint8_t* q, int64_t q_stride,
                                                                float* scale, float eps) {
  using P = Pack<T, kVec>;
  using Codes = Pack<uint8_t, kVec>;
  constexpr int kHeld = 4;
  const int64_t row = blockIdx.x;
  if constexpr (kFp8) {
    if (row >= rows) {
      for (int64_t j = threadIdx.x; j < q_stride / kVec; j += kThreads)
        reinterpret_cast<Codes*>(q + row * q_stride)[j] = Codes{};
      if (threadIdx.x == 0) scale[row] = 1.f;
      return;
    }
  }
  T* xr = x + row * x_stride;
  const T* ar = add + row * add_stride;
  const float as = add_scale != nullptr ? add_scale[row] : 1.f;
  const int64_t vecs = width / kVec;
  P held[kHeld];
  float sq = 0.f;
  for (int64_t j = threadIdx.x, n = 0; j < vecs; j += kThreads, ++n) {
    P px = reinterpret_cast<const P*>(xr)[j];
    const P pa = reinterpret_cast<const P*>(ar)[j];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float a = add_scale != nullptr ? to_f(from_f<T>(__fmul_rn(to_f(pa.v[i]), as))) : to_f(pa.v[i]);
      px.v[i] = from_f<T>(to_f(px.v[i]) + a);
      const float y = to_f(px.v[i]);
      sq = fmaf(y, y, sq);
    }
    reinterpret_cast<P*>(xr)[j] = px;
#pragma unroll
    for (int h = 0; h < kHeld; ++h)
      if (h == n) held[h] = px;
  }
  __shared__ float partial[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sq;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  const float rstd = rsqrtf(total / static_cast<float>(width) + eps);
  // The normed values of vector j (n-th of this thread): from `held` or from x again.
  const auto normed = [&](int64_t j, int64_t n) {
    P py;
    if (n < kHeld) {
#pragma unroll
      for (int h = 0; h < kHeld; ++h)
        if (h == n) py = held[h];
    } else {
      py = reinterpret_cast<const P*>(xr)[j];
    }
    const P pw = reinterpret_cast<const P*>(weight)[j];
    P po;
#pragma unroll
    for (int i = 0; i < kVec; ++i) po.v[i] = from_f<T>(to_f(py.v[i]) * rstd * to_f(pw.v[i]));
    return po;
  };
  float amax = 0.f;
  for (int64_t j = threadIdx.x, n = 0; j < vecs; j += kThreads, ++n) {
    const P po = normed(j, n);
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) amax = fmaxf(amax, fabsf(to_f(po.v[i])));
#pragma unroll
      for (int h = 0; h < kHeld; ++h)
        if (h == n) held[h] = po;
    } else {
      reinterpret_cast<P*>(out + row * out_stride)[j] = po;
    }
  }
  if constexpr (kFp8) {
    const float s = fp8_scale(block_max(amax));
    for (int64_t j = threadIdx.x, n = 0; j < q_stride / kVec; j += kThreads, ++n) {
      Codes c{};
      if (j < vecs) {
        P po;
        if (n < kHeld) {
#pragma unroll
          for (int h = 0; h < kHeld; ++h)
            if (h == n) po = held[h];
        } else {
          po = normed(j, n);
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) c.v[i] = fp8_code(to_f(po.v[i]), s);
      }
      reinterpret_cast<Codes*>(q + row * q_stride)[j] = c;
    }
    if (threadIdx.x == 0) scale[row] = s;
  }
}

template <class T, bool kFp8>
void launch(void* x, const void* add, const float* add_scale, const void* weight, void* out, int64_t rows,
            int64_t grid_rows, int64_t width, int64_t x_stride, int64_t add_stride, int64_t out_stride, void* q,
            int64_t q_stride, float* scale, float eps, cudaStream_t s) {
  constexpr int kVec = 16 / sizeof(T);
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = width % kVec == 0 && x_stride % kVec == 0 && add_stride % kVec == 0 && out_stride % kVec == 0 &&
                   aligned(x) && aligned(add) && aligned(weight) && aligned(out) &&
                   (!kFp8 || (q_stride % kVec == 0 && reinterpret_cast<uintptr_t>(q) % kVec == 0));
  const auto grid = static_cast<unsigned>(grid_rows);
  auto go = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, s>>>(static_cast<T*>(x), static_cast<const T*>(add), add_scale,
                                     static_cast<const T*>(weight), static_cast<T*>(out), rows, width, x_stride,
                                     add_stride, out_stride, static_cast<uint8_t*>(q), q_stride, scale, eps);
  };
  if (vec)
    go(add_rms_norm_kernel<T, kVec, kFp8>);
  else
    go(add_rms_norm_kernel<T, 1, kFp8>);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("add_rms_norm launch: ") + cudaGetErrorString(err));
}

}  // namespace

void add_rms_norm(DType dtype, void* x, const void* add, const void* weight, void* out, int64_t tokens, int64_t width,
                  int64_t x_stride, int64_t add_stride, int64_t out_stride, float eps, void* stream) {
  if (tokens == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type, false>(x, add, nullptr, weight, out, tokens, tokens, width, x_stride,
                                              add_stride, out_stride, nullptr, 0, nullptr, eps, s);
  });
}

void add_rms_norm_fp8(DType dtype, void* x, const void* add, const float* add_scale, const void* weight, int64_t rows,
                      int64_t padded_rows, int64_t width, int64_t x_stride, int64_t add_stride, void* q,
                      int64_t q_stride, float* scale, float eps, void* stream) {
  if (padded_rows < rows || padded_rows > 2147483647 || q_stride < width || q_stride % 4 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 4 != 0)
    throw std::invalid_argument("add_rms_norm_fp8: q must hold every column of every padded row in 4-byte aligned rows");
  if (padded_rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type, true>(x, add, add_scale, weight, nullptr, rows, padded_rows, width, x_stride,
                                             add_stride, 0, q, q_stride, scale, eps, s);
  });
}

}  // namespace tiller::model::cuda
