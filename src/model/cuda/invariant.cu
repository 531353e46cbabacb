// The batch-invariant kernels of algo.logprob_match = bitwise on CUDA (model/batch_invariant.h):
// one thread block per row, each thread's share of the row read element by element in a fixed
// order (no vector path whose grouping depends on where a row sits in memory), the block's
// partial results combined in one fixed order. So a row's result depends on that row alone.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;  // elements per chunk

void check_launch(const char* what) {
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": kernel launch failed: " + cudaGetErrorString(err));
}

// The block's sum of one value per thread: each warp's butterfly, then the warps' partials in
// warp order (every thread gets the same result).
template <int kBlock = kThreads>
__device__ __forceinline__ float block_sum(float v, float* partial) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();  // partial may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kBlock / 32; ++w) total += partial[w];
  return total;
}

template <int kBlock = kThreads>
__device__ __forceinline__ float block_max(float v, float* partial) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kBlock / 32; ++w) m = fmaxf(m, partial[w]);
  return m;
}

// A row's elements in one order, whatever its alignment: thread t takes the chunks of kVec
// elements t, t + kBlock, ... (each chunk's elements in order), then the row's last width % kVec
// elements one each (threads 0, 1, ...). `vec` only says whether a chunk arrives as one vector
// load or element by element.
template <class T>
struct Chunk {
  float v[kVec];
};
template <class T>
__device__ __forceinline__ Chunk<T> load_chunk(const T* p, bool vec) {
  Chunk<T> c;
  if (vec) {
    const Pack<T, kVec> x = *reinterpret_cast<const Pack<T, kVec>*>(p);
#pragma unroll
    for (int i = 0; i < kVec; ++i) c.v[i] = to_f(x.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) c.v[i] = to_f(p[i]);
  }
  return c;
}
template <class T>
__device__ __forceinline__ bool vector_ok(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0;
}

// x = T(x + add) in place when kAdd; then out = T(x * rsqrt(mean(x^2) + eps) * weight), the
// statistics in fp32 over the rounded x.
template <class T, bool kAdd>
__global__ void __launch_bounds__(kThreads) rms_norm_rows_kernel(T* x, const T* add, const T* weight, T* out,
                                                                 int64_t width, int64_t x_stride, int64_t add_stride,
                                                                 float eps) {
  __shared__ float partial[kWarps];
  T* xr = x + blockIdx.x * x_stride;
  const T* ar = kAdd ? add + blockIdx.x * add_stride : nullptr;
  T* orow = out + blockIdx.x * width;
  const int64_t chunks = width / kVec, tail = width % kVec;
  const bool vec = vector_ok<T>(xr) && (!kAdd || vector_ok<T>(ar)) && vector_ok<T>(orow) && vector_ok<T>(weight);
  float sq = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    Chunk<T> v = load_chunk(xr + c * kVec, vec);
    if constexpr (kAdd) {
      const Chunk<T> a = load_chunk(ar + c * kVec, vec);
      Pack<T, kVec> y;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        y.v[i] = from_f<T>(v.v[i] + a.v[i]);
        v.v[i] = to_f(y.v[i]);
      }
      if (vec) {
        *reinterpret_cast<Pack<T, kVec>*>(xr + c * kVec) = y;
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) xr[c * kVec + i] = y.v[i];
      }
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) sq = fmaf(v.v[i], v.v[i], sq);
  }
  if (threadIdx.x < tail) {
    const int64_t j = chunks * kVec + threadIdx.x;
    float v = to_f(xr[j]);
    if constexpr (kAdd) {
      const T y = from_f<T>(v + to_f(ar[j]));
      xr[j] = y;
      v = to_f(y);
    }
    sq = fmaf(v, v, sq);
  }
  const float rstd = rsqrtf(block_sum(sq, partial) / static_cast<float>(width) + eps);
  // Each thread reads back only the elements it wrote.
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    const Chunk<T> v = load_chunk(xr + c * kVec, vec), w = load_chunk(weight + c * kVec, vec);
    Pack<T, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = from_f<T>(v.v[i] * rstd * w.v[i]);
    if (vec) {
      *reinterpret_cast<Pack<T, kVec>*>(orow + c * kVec) = o;
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) orow[c * kVec + i] = o.v[i];
    }
  }
  if (threadIdx.x < tail) {
    const int64_t j = chunks * kVec + threadIdx.x;
    orow[j] = from_f<T>(to_f(xr[j]) * rstd * to_f(weight[j]));
  }
}

// out[r] = T(x[r] . w) (+ bias): a one-column product, the sum in fp32 in the rows' one order
// (each thread's chunks, then the block's threads; a value head's, where a GEMM's kernel for one
// output column would follow the batch).
template <class T>
__global__ void __launch_bounds__(kThreads) row_dot_kernel(const T* x, int64_t x_stride, const T* w, const T* bias,
                                                            T* out, int64_t width) {
  __shared__ float partial[kWarps];
  const T* xr = x + blockIdx.x * x_stride;
  const int64_t chunks = width / kVec, tail = width % kVec;
  const bool vec = vector_ok<T>(xr) && vector_ok<T>(w);
  float acc = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    const Chunk<T> a = load_chunk(xr + c * kVec, vec), b = load_chunk(w + c * kVec, vec);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc = fmaf(a.v[i], b.v[i], acc);
  }
  if (threadIdx.x < tail) {
    const int64_t j = chunks * kVec + threadIdx.x;
    acc = fmaf(to_f(xr[j]), to_f(w[j]), acc);
  }
  const float total = block_sum(acc, partial);
  if (threadIdx.x == 0) out[blockIdx.x] = from_f<T>(bias ? total + to_f(*bias) : total);
}

// softmax(x[r]) in fp32 (a mixture of experts' router).
__global__ void __launch_bounds__(kThreads) softmax_rows_kernel(const float* x, float* out, int64_t width) {
  __shared__ float partial[kWarps];
  const float* xr = x + blockIdx.x * width;
  float* orow = out + blockIdx.x * width;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < width; j += kThreads) mx = fmaxf(mx, xr[j]);
  mx = block_max(mx, partial);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < width; j += kThreads) {
    const float e = expf(xr[j] - mx);
    orow[j] = e;
    sum += e;
  }
  sum = block_sum(sum, partial);
  for (int64_t j = threadIdx.x; j < width; j += kThreads) orow[j] /= sum;
}

// cos and sin of each fp32 element, times scaling: one thread an element, CUDA's cosf and sinf
// (no fast-math forms), so an element's result depends on its value alone.
__global__ void rope_tables_kernel(const float* freqs, float* cos_out, float* sin_out, int64_t n, float scaling,
                                   bool scaled) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float f = freqs[i];
  float c = cosf(f), s = sinf(f);
  if (scaled) {
    c *= scaling;
    s *= scaling;
  }
  cos_out[i] = c;
  sin_out[i] = s;
}

}  // namespace

void invariant_rope_tables(const float* freqs, float* cos_out, float* sin_out, int64_t n, float scaling, bool scaled,
                           void* stream) {
  if (n == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks > 0x7fffffff) throw std::invalid_argument("invariant RoPE tables: more than 2^39 elements");
  rope_tables_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      freqs, cos_out, sin_out, n, scaling, scaled);
  check_launch("invariant RoPE tables");
}

void invariant_softmax(const float* x, float* out, int64_t rows, int64_t width, void* stream) {
  if (rows == 0 || width == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant softmax: more than 2^31 - 1 rows");
  softmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, out, width);
  check_launch("invariant softmax");
}

void invariant_row_dot(DType dtype, const void* x, int64_t x_stride, const void* w, const void* bias, void* out,
                       int64_t rows, int64_t width, void* stream) {
  if (rows == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant one-column product: more than 2^31 - 1 rows");
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    row_dot_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), x_stride, static_cast<const T*>(w), static_cast<const T*>(bias), static_cast<T*>(out),
        width);
  });
  check_launch("invariant one-column product");
}

void invariant_rms_norm(DType dtype, const void* x, const void* weight, void* out, int64_t rows, int64_t width,
                        float eps, void* stream) {
  if (rows == 0 || width == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant RMSNorm: more than 2^31 - 1 rows");
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    rms_norm_rows_kernel<T, false><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        const_cast<T*>(static_cast<const T*>(x)), nullptr, static_cast<const T*>(weight), static_cast<T*>(out), width,
        width, 0, eps);
  });
  check_launch("invariant RMSNorm");
}

void invariant_add_rms_norm(DType dtype, void* x, const void* add, const void* weight, void* out, int64_t rows,
                            int64_t width, int64_t x_stride, int64_t add_stride, float eps, void* stream) {
  if (rows == 0 || width == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant RMSNorm: more than 2^31 - 1 rows");
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    rms_norm_rows_kernel<T, true><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(x), static_cast<const T*>(add), static_cast<const T*>(weight), static_cast<T*>(out), width,
        x_stride, add_stride, eps);
  });
  check_launch("invariant residual add and RMSNorm");
}

}  // namespace tiller::model::cuda
