// The residual add fused with the RMSNorm after it (inference): one read of the stream and the
// addend, one write of each result.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int kThreads = 256;

// One thread block per row. The row's y = T(x + add) stays in registers (up to kHeld vectors
// per thread; rows wider than kThreads * kHeld * kVec are read back from x), stored into x, and
// the sum of y^2 in fp32 gives rstd; out = T(y * rstd * weight), as ATen's rms_norm computes it.
template <class T, int kVec>
__global__ void __launch_bounds__(kThreads) add_rms_norm_kernel(T* x, const T* add, const T* weight, T* out,
                                                                int64_t width, int64_t x_stride, int64_t add_stride,
                                                                int64_t out_stride, float eps) {
  using P = Pack<T, kVec>;
  constexpr int kHeld = 4;
  const int64_t row = blockIdx.x;
  T* xr = x + row * x_stride;
  const T* ar = add + row * add_stride;
  T* orow = out + row * out_stride;
  const int64_t vecs = width / kVec;
  P held[kHeld];
  float sq = 0.f;
  for (int64_t j = threadIdx.x, n = 0; j < vecs; j += kThreads, ++n) {
    P px = reinterpret_cast<const P*>(xr)[j];
    const P pa = reinterpret_cast<const P*>(ar)[j];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      px.v[i] = from_f<T>(to_f(px.v[i]) + to_f(pa.v[i]));
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
  for (int64_t j = threadIdx.x, n = 0; j < vecs; j += kThreads, ++n) {
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
    reinterpret_cast<P*>(orow)[j] = po;
  }
}

template <class T>
void launch(void* x, const void* add, const void* weight, void* out, int64_t tokens, int64_t width, int64_t x_stride,
            int64_t add_stride, int64_t out_stride, float eps, cudaStream_t s) {
  constexpr int kVec = 16 / sizeof(T);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = width % kVec == 0 && x_stride % kVec == 0 && add_stride % kVec == 0 && out_stride % kVec == 0 &&
                   aligned(x) && aligned(add) && aligned(weight) && aligned(out);
  const auto grid = static_cast<unsigned>(tokens);
  if (vec)
    add_rms_norm_kernel<T, kVec><<<grid, kThreads, 0, s>>>(static_cast<T*>(x), static_cast<const T*>(add),
                                                           static_cast<const T*>(weight), static_cast<T*>(out), width,
                                                           x_stride, add_stride, out_stride, eps);
  else
    add_rms_norm_kernel<T, 1><<<grid, kThreads, 0, s>>>(static_cast<T*>(x), static_cast<const T*>(add),
                                                        static_cast<const T*>(weight), static_cast<T*>(out), width,
                                                        x_stride, add_stride, out_stride, eps);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("add_rms_norm launch: ") + cudaGetErrorString(err));
}

}  // namespace

void add_rms_norm(DType dtype, void* x, const void* add, const void* weight, void* out, int64_t tokens, int64_t width,
                  int64_t x_stride, int64_t add_stride, int64_t out_stride, float eps, void* stream) {
  if (tokens == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type>(x, add, weight, out, tokens, width, x_stride, add_stride, out_stride, eps, s);
  });
}

}  // namespace tiller::model::cuda
