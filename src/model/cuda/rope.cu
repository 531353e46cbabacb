// Fused rotary embedding: one read of x and the tables, one write, per element pair.
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

// One thread per (token, head, kVec consecutive i < dim/2): the pairs (i, i + dim/2), moved as
// vectors when the layout allows (kVec = 16 bytes), else one at a time (kVec = 1).
//   forward:  out1 = x1 c1 - x2 s1,  out2 = x2 c2 + x1 s2
//   backward: out1 = g1 c1 + g2 s2,  out2 = g2 c2 - g1 s1
template <class T, int kVec>
__global__ void rope_kernel(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads,
                            int64_t dim, int64_t tok_stride, int64_t head_stride, bool backward) {
  using P = Pack<T, kVec>;
  const int64_t half = dim / 2, vecs = half / kVec;
  const int64_t total = tokens * heads * vecs;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = (idx % vecs) * kVec;
    const int64_t th = idx / vecs;
    const int64_t h = th % heads, t = th / heads;
    const T* xp = x + t * tok_stride + h * head_stride;
    const T* cp = cos + t * dim;
    const T* sp = sin + t * dim;
    const P a = *reinterpret_cast<const P*>(xp + i), b = *reinterpret_cast<const P*>(xp + i + half);
    const P c1 = *reinterpret_cast<const P*>(cp + i), c2 = *reinterpret_cast<const P*>(cp + i + half);
    const P s1 = *reinterpret_cast<const P*>(sp + i), s2 = *reinterpret_cast<const P*>(sp + i + half);
    P o1, o2;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float av = to_f(a.v[e]), bv = to_f(b.v[e]);
      if (backward) {
        o1.v[e] = from_f<T>(av * to_f(c1.v[e]) + bv * to_f(s2.v[e]));
        o2.v[e] = from_f<T>(bv * to_f(c2.v[e]) - av * to_f(s1.v[e]));
      } else {
        float f1, f2;
        rope_pair(av, bv, to_f(c1.v[e]), to_f(s1.v[e]), to_f(c2.v[e]), to_f(s2.v[e]), f1, f2);
        o1.v[e] = from_f<T>(f1);
        o2.v[e] = from_f<T>(f2);
      }
    }
    T* op = out + (t * heads + h) * dim;
    *reinterpret_cast<P*>(op + i) = o1;
    *reinterpret_cast<P*>(op + i + half) = o2;
  }
}

template <class T>
void launch(const void* x, const void* cos, const void* sin, void* out, int64_t tokens, int64_t heads, int64_t dim,
            int64_t tok_stride, int64_t head_stride, bool backward, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = (dim / 2) % kVec == 0 && tok_stride % kVec == 0 && head_stride % kVec == 0 && aligned(x) &&
                   aligned(cos) && aligned(sin) && aligned(out);
  const int64_t total = tokens * heads * (dim / 2) / (vec ? kVec : 1);
  if (total == 0) return;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  auto go = [&](auto kernel) {
    kernel<<<grid, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(cos),
                                         static_cast<const T*>(sin), static_cast<T*>(out), tokens, heads, dim,
                                         tok_stride, head_stride, backward);
  };
  if (vec) go(rope_kernel<T, kVec>);
  else go(rope_kernel<T, 1>);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("rope kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace

void rope(DType dtype, const void* x, const void* cos, const void* sin, void* out, int64_t tokens, int64_t heads,
          int64_t dim, int64_t x_token_stride, int64_t x_head_stride, bool backward, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type>(x, cos, sin, out, tokens, heads, dim, x_token_stride, x_head_stride, backward,
                                       s);
  });
}

}  // namespace tiller::model::cuda
