// silu(gate) * up over the fused gate/up projection: one read of each input, one write.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

// kVec elements per thread (16 bytes) when the row allows it, else 1.
template <class T, int kVec>
__global__ void swiglu_kernel(const T* x, T* out, int64_t tokens, int64_t width, int64_t stride) {
  const int64_t per_row = width / kVec;
  const int64_t total = tokens * per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_row, j = (idx % per_row) * kVec;
    const T* g = x + t * stride + j;
    const T* u = g + width;
    T* o = out + t * width + j;
    if constexpr (kVec == 1) {
      const float gv = to_f(*g);
      *o = from_f<T>(gv / (1.f + expf(-gv)) * to_f(*u));
    } else {
      union Pack {
        uint4 raw;
        T v[kVec];
      } pg, pu, po;
      pg.raw = *reinterpret_cast<const uint4*>(g);
      pu.raw = *reinterpret_cast<const uint4*>(u);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gv = to_f(pg.v[i]);
        po.v[i] = from_f<T>(gv / (1.f + expf(-gv)) * to_f(pu.v[i]));
      }
      *reinterpret_cast<uint4*>(o) = po.raw;
    }
  }
}

template <class T>
void launch(const void* x, void* out, int64_t tokens, int64_t width, int64_t stride, cudaStream_t s) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = width % kVec == 0 && stride % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t items = tokens * (vec ? width / kVec : width);
  if (items == 0) return;
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((items + threads - 1) / threads, 65535 * 8));
  if (vec)
    swiglu_kernel<T, kVec><<<blocks, threads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(out), tokens, width, stride);
  else
    swiglu_kernel<T, 1><<<blocks, threads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(out), tokens, width, stride);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("swiglu kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace

void swiglu_packed(DType dtype, const void* x, void* out, int64_t tokens, int64_t width, int64_t x_row_stride,
                   void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) { launch<typename decltype(t)::type>(x, out, tokens, width, x_row_stride, s); });
}

}  // namespace tiller::model::cuda
