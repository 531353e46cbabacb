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

void check_launch(const char* what) {
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": kernel launch failed: " + cudaGetErrorString(err));
}

// The block's sum of one value per thread: each warp's butterfly, then the warps' partials in
// warp order (every thread gets the same result).
__device__ __forceinline__ float block_sum(float v, float* partial) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();  // partial may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += partial[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* partial) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, partial[w]);
  return m;
}

// out = T(x * rsqrt(mean(x^2) + eps) * weight), the statistics in fp32.
template <class T>
__global__ void __launch_bounds__(kThreads) rms_norm_rows_kernel(const T* x, const T* weight, T* out, int64_t width,
                                                                 float eps) {
  __shared__ float partial[kWarps];
  const T* xr = x + blockIdx.x * width;
  T* orow = out + blockIdx.x * width;
  float sq = 0.f;
  for (int64_t j = threadIdx.x; j < width; j += kThreads) {
    const float v = to_f(xr[j]);
    sq = fmaf(v, v, sq);
  }
  const float rstd = rsqrtf(block_sum(sq, partial) / static_cast<float>(width) + eps);
  for (int64_t j = threadIdx.x; j < width; j += kThreads) orow[j] = from_f<T>(to_f(xr[j]) * rstd * to_f(weight[j]));
}

// logprobs[r] = z[target] - max(z) - log(sum(exp(z - max(z)))), z = logits[r] / temperature.
template <class T>
__global__ void __launch_bounds__(kThreads) logprob_rows_kernel(const T* logits, int64_t vocab, int64_t row_stride,
                                                                const int64_t* targets, const float* temperatures,
                                                                bool per_row, float* out) {
  __shared__ float partial[kWarps];
  const int64_t r = blockIdx.x;
  const T* z = logits + r * row_stride;
  const float t = temperatures[per_row ? r : 0];
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) mx = fmaxf(mx, to_f(z[j]) / t);
  mx = block_max(mx, partial);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) sum += expf(to_f(z[j]) / t - mx);
  sum = block_sum(sum, partial);
  if (threadIdx.x == 0) {
    const int64_t target = targets[r];
    out[r] = target >= 0 && target < vocab ? to_f(z[target]) / t - mx - logf(sum) : NAN;
  }
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

}  // namespace

void invariant_softmax(const float* x, float* out, int64_t rows, int64_t width, void* stream) {
  if (rows == 0 || width == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant softmax: more than 2^31 - 1 rows");
  softmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, out, width);
  check_launch("invariant softmax");
}

void invariant_rms_norm(DType dtype, const void* x, const void* weight, void* out, int64_t rows, int64_t width,
                        float eps, void* stream) {
  if (rows == 0 || width == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant RMSNorm: more than 2^31 - 1 rows");
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    rms_norm_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<T*>(out), width, eps);
  });
  check_launch("invariant RMSNorm");
}

void invariant_logprobs(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                        const int64_t* targets, const float* temperatures, bool per_row, float* logprobs,
                        void* stream) {
  if (rows == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant log-probs: more than 2^31 - 1 rows");
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    logprob_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(logits), vocab, row_stride, targets, temperatures, per_row, logprobs);
  });
  check_launch("invariant log-probs");
}

}  // namespace tiller::model::cuda
