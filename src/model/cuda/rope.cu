// Fused rotary embedding: one read of x and the tables, one write, per element pair.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// One thread per (token, head, i < dim/2): the pair (i, i + dim/2).
//   forward:  out1 = x1 c1 - x2 s1,  out2 = x2 c2 + x1 s2
//   backward: out1 = g1 c1 + g2 s2,  out2 = g2 c2 - g1 s1
template <class T>
__global__ void rope_kernel(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads,
                            int64_t dim, int64_t tok_stride, int64_t head_stride, bool backward) {
  const int64_t half = dim / 2;
  const int64_t total = tokens * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t th = idx / half;
    const int64_t h = th % heads, t = th / heads;
    const T* xp = x + t * tok_stride + h * head_stride;
    const T* cp = cos + t * dim;
    const T* sp = sin + t * dim;
    const float a = load(xp + i), b = load(xp + i + half);
    const float c1 = load(cp + i), c2 = load(cp + i + half), s1 = load(sp + i), s2 = load(sp + i + half);
    T* op = out + (t * heads + h) * dim;
    if (backward) {
      store(op + i, a * c1 + b * s2);
      store(op + i + half, b * c2 - a * s1);
    } else {
      store(op + i, a * c1 - b * s1);
      store(op + i + half, b * c2 + a * s2);
    }
  }
}

template <class T>
void launch(const void* x, const void* cos, const void* sin, void* out, int64_t tokens, int64_t heads, int64_t dim,
            int64_t tok_stride, int64_t head_stride, bool backward, cudaStream_t stream) {
  const int64_t total = tokens * heads * (dim / 2);
  if (total == 0) return;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  rope_kernel<T><<<grid, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(cos),
                                               static_cast<const T*>(sin), static_cast<T*>(out), tokens, heads, dim,
                                               tok_stride, head_stride, backward);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("rope kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace

void rope(DType dtype, const void* x, const void* cos, const void* sin, void* out, int64_t tokens, int64_t heads,
          int64_t dim, int64_t x_token_stride, int64_t x_head_stride, bool backward, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(x, cos, sin, out, tokens, heads, dim, x_token_stride, x_head_stride, backward, s);
    case DType::kHalf:
      return launch<__half>(x, cos, sin, out, tokens, heads, dim, x_token_stride, x_head_stride, backward, s);
    case DType::kFloat:
      return launch<float>(x, cos, sin, out, tokens, heads, dim, x_token_stride, x_head_stride, backward, s);
  }
}

}  // namespace tiller::model::cuda
