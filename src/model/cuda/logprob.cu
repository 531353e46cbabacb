// The LM head's log-prob and entropy, forward and backward, on the logits' storage dtype
// (kernels.h: logprob_rows, logprob_rows_backward). One thread block per row of logits:
//   pass 1  running (max, sum of exp, sum of exp x value) of y = z / T, in log2 units, with
//           16-byte loads: the row's log-sum-exp and the mean of y under softmax(y), whence
//           the entropy H = lse - E[y]
//   forward the target's log-prob y[target] - lse, and H
//   pass 2  (backward) d loss / d z = (g (onehot - p) - g_H p (log p + H)) / T, written over z
// No fp32 copy of a row exists; the math is fp32 in registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kPer = 8;  // consecutive elements per thread and load
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

// Up to eight consecutive values from `i` as fp32; `vec`: a 16-byte-aligned row whose length is
// a multiple of 8 (wide loads). Returns how many are in range.
template <class T>
__device__ __forceinline__ int load8(const T* x, int i, int n, bool vec, float (&v)[kPer]) {
  if (vec) {
    constexpr int kLoads = sizeof(T) * kPer / 16;
    uint4 raw[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) raw[j] = reinterpret_cast<const uint4*>(x + i)[j];
    const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[j] = to_f(e[j]);
    return kPer;
  }
  const int cnt = min(kPer, n - i);
#pragma unroll
  for (int j = 0; j < kPer; ++j) v[j] = j < cnt ? to_f(x[i + j]) : 0.f;
  return cnt;
}

template <class T>
__device__ __forceinline__ void store8(T* x, int i, int cnt, bool vec, const float (&v)[kPer]) {
  if (vec) {
    Pack<T, kPer> p;
#pragma unroll
    for (int j = 0; j < kPer; ++j) p.v[j] = from_f<T>(v[j]);
    constexpr int kStores = sizeof(T) * kPer / 16;
#pragma unroll
    for (int j = 0; j < kStores; ++j) reinterpret_cast<uint4*>(x + i)[j] = reinterpret_cast<const uint4*>(&p)[j];
    return;
  }
  for (int j = 0; j < cnt; ++j) x[i + j] = from_f<T>(v[j]);
}

// (max m, sum s of 2^(u - m), sum t of 2^(u - m) u) over values u in log2 units, merged.
struct Stats {
  float m = -INFINITY, s = 0.f, t = 0.f;
};
__device__ __forceinline__ void merge(Stats& a, float m2, float s2, float t2) {
  const float mx = fmaxf(a.m, m2);
  if (mx == -INFINITY) return;
  const float fa = exp2f(a.m - mx), fb = exp2f(m2 - mx);
  a.s = a.s * fa + s2 * fb;
  a.t = a.t * fa + t2 * fb;
  a.m = mx;
}

struct RowStats {
  float lse, entropy;  // natural units of y = z / T
};

// Pass 1 over row x of n values with k = log2(e) / T; every thread of the block gets the result.
template <class T>
__device__ RowStats row_stats(const T* x, int n, bool vec, float k) {
  __shared__ float s_m[kWarps], s_s[kWarps], s_t[kWarps];
  __shared__ RowStats s_out;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  Stats st;
  for (int i0 = tid * kPer; i0 < n; i0 += kThreads * kPer) {
    float v[kPer];
    const int cnt = load8(x, i0, n, vec, v);
    float local = -INFINITY;
#pragma unroll
    for (int e = 0; e < kPer; ++e)
      if (e < cnt) local = fmaxf(local, v[e] * k);
    if (local > st.m) {
      const float f = exp2f(st.m - local);
      st.s *= f;
      st.t *= f;
      st.m = local;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (e < cnt) {
        const float u = v[e] * k;
        const float w = exp2f(u - st.m);
        st.s += w;
        st.t += w * u;
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    merge(st, __shfl_xor_sync(kFull, st.m, off), __shfl_xor_sync(kFull, st.s, off), __shfl_xor_sync(kFull, st.t, off));
  if (lane == 0) {
    s_m[warp] = st.m;
    s_s[warp] = st.s;
    s_t[warp] = st.t;
  }
  __syncthreads();
  if (tid == 0) {
    Stats all;
    for (int w = 0; w < kWarps; ++w) merge(all, s_m[w], s_s[w], s_t[w]);
    const float lse2 = all.m + log2f(all.s);                 // log2-sum-exp2 of u
    s_out.lse = lse2 * kLn2;
    s_out.entropy = (lse2 - all.t / all.s) * kLn2;           // lse - E[y], in natural units
  }
  __syncthreads();
  return s_out;
}

template <class T>
__global__ void __launch_bounds__(kThreads) logprob_rows_kernel(const T* logits, int vocab, int64_t row_stride, bool vec,
                                                                const int64_t* targets, float inv_t, float* logprobs,
                                                                float* entropy) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const RowStats r = row_stats(x, vocab, vec, inv_t * kLog2e);
  if (threadIdx.x == 0) {
    const int64_t target = targets[row];
    logprobs[row] = target >= 0 && target < vocab ? to_f(x[target]) * inv_t - r.lse : NAN;
    if (entropy) entropy[row] = r.entropy;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) logprob_rows_backward_kernel(T* logits, int vocab, int64_t row_stride,
                                                                         bool vec, const int64_t* targets, float inv_t,
                                                                         const float* grad, const float* grad_entropy) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * row_stride;
  const RowStats r = row_stats(x, vocab, vec, inv_t * kLog2e);
  const float g = grad ? grad[row] : 0.f, ge = grad_entropy ? grad_entropy[row] : 0.f;
  const int64_t target = targets[row];
  for (int i0 = threadIdx.x * kPer; i0 < vocab; i0 += kThreads * kPer) {
    float v[kPer];
    const int cnt = load8(x, i0, vocab, vec, v);
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const float logp = v[e] * inv_t - r.lse;
      const float p = __expf(logp);
      float d = -p * (g + ge * (logp + r.entropy));
      if (i0 + e == target) d += g;
      v[e] = d * inv_t;
    }
    store8(x, i0, cnt, vec, v);
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
bool vectorizable(const void* logits, int64_t vocab, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(logits) % 16 == 0 && vocab % kPer == 0 && row_stride % kPer == 0;
}

void check_shape(int64_t rows, int64_t vocab) {
  if (rows < 0 || rows > (int64_t{1} << 31) - 1 || vocab <= 0 || vocab > (int64_t{1} << 30))
    throw std::invalid_argument("logprob_rows: rows " + std::to_string(rows) + " or vocabulary " +
                                std::to_string(vocab) + " out of range");
}

}  // namespace

void logprob_rows(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                  const int64_t* targets, float inv_temperature, float* logprobs, float* entropy, void* stream) {
  check_shape(rows, vocab);
  if (rows == 0) return;
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    logprob_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(logits), static_cast<int>(vocab), row_stride,
        vectorizable<T>(logits, vocab, row_stride), targets, inv_temperature, logprobs, entropy);
  });
  check(cudaGetLastError(), "logprob_rows");
}

void logprob_rows_backward(DType dtype, void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                           const int64_t* targets, float inv_temperature, const float* grad, const float* grad_entropy,
                           void* stream) {
  check_shape(rows, vocab);
  if (rows == 0) return;
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    logprob_rows_backward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(logits), static_cast<int>(vocab), row_stride, vectorizable<T>(logits, vocab, row_stride),
        targets, inv_temperature, grad, grad_entropy);
  });
  check(cudaGetLastError(), "logprob_rows_backward");
}

}  // namespace tiller::model::cuda
