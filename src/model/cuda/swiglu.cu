// silu(gate) * up (the fused gate/up projection's output, or separate gate and up) and its
// backward: one read of each input, one write of each output.
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

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// kVec elements per thread (16 bytes) when the rows allow it, else 1. Forward: out = silu(g) u.
// Backward (grad given): dg = grad u silu'(g), du = grad silu(g), written to out and out2.
template <class T, int kVec, bool kBackward>
__global__ void swiglu_kernel(const T* gate, int64_t g_stride, const T* up, int64_t u_stride, const T* grad, T* out,
                              T* out2, int64_t tokens, int64_t width) {
  using P = Pack<T, kVec>;
  const int64_t per_row = width / kVec;
  const int64_t total = tokens * per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_row, j = (idx % per_row) * kVec;
    const P g = *reinterpret_cast<const P*>(gate + t * g_stride + j);
    const P u = *reinterpret_cast<const P*>(up + t * u_stride + j);
    P o, o2;
    if constexpr (kBackward) {
      const P d = *reinterpret_cast<const P*>(grad + t * width + j);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gv = to_f(g.v[i]), uv = to_f(u.v[i]), dv = to_f(d.v[i]), sg = sigmoid(gv);
        o.v[i] = from_f<T>(dv * uv * (sg * (1.f + gv * (1.f - sg))));
        o2.v[i] = from_f<T>(dv * (gv * sg));
      }
      *reinterpret_cast<P*>(out2 + t * width + j) = o2;
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gv = to_f(g.v[i]);
        o.v[i] = from_f<T>(gv / (1.f + expf(-gv)) * to_f(u.v[i]));
      }
    }
    *reinterpret_cast<P*>(out + t * width + j) = o;
  }
}

template <class T, bool kBackward>
void launch(const void* gate, int64_t g_stride, const void* up, int64_t u_stride, const void* grad, void* out,
            void* out2, int64_t tokens, int64_t width, cudaStream_t s) {
  constexpr int kVec = 16 / sizeof(T);
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = width % kVec == 0 && g_stride % kVec == 0 && u_stride % kVec == 0 && aligned(gate) &&
                   aligned(up) && aligned(grad) && aligned(out) && aligned(out2);
  const int64_t items = tokens * (vec ? width / kVec : width);
  if (items == 0) return;
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((items + threads - 1) / threads, 65535 * 8));
  auto go = [&](auto kernel) {
    kernel<<<blocks, threads, 0, s>>>(static_cast<const T*>(gate), g_stride, static_cast<const T*>(up), u_stride,
                                      static_cast<const T*>(grad), static_cast<T*>(out), static_cast<T*>(out2), tokens,
                                      width);
  };
  if (vec) go(swiglu_kernel<T, kVec, kBackward>);
  else go(swiglu_kernel<T, 1, kBackward>);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("swiglu kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace

void swiglu_packed(DType dtype, const void* x, void* out, int64_t tokens, int64_t width, int64_t x_row_stride,
                   void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    launch<T, false>(x, x_row_stride, static_cast<const T*>(x) + width, x_row_stride, nullptr, out, nullptr, tokens,
                     width, s);
  });
}

void swiglu(DType dtype, const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* out,
            int64_t tokens, int64_t width, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type, false>(gate, gate_stride, up, up_stride, nullptr, out, nullptr, tokens, width, s);
  });
}

void swiglu_backward(DType dtype, const void* gate, const void* up, const void* grad, void* grad_gate, void* grad_up,
                     int64_t tokens, int64_t width, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type, true>(gate, width, up, width, grad, grad_gate, grad_up, tokens, width, s);
  });
}

}  // namespace tiller::model::cuda
