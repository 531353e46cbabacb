// The sampler's one-kernel path (kernels.h: sample_rows): one thread block per row of logits.
//   pass 1  the first maximum of the logits (greedy), and the running max and sum of
//           exp2((x / T) log2 e) (the row's log-sum-exp);
//   pass 2  (only with min_p) the kept mass: tokens with p >= min_p * p_max;
//   pass 3  tiles of 8 consecutive tokens per thread, block-scanned in token order with a
//           running base; the first thread whose running mass passes u * total walks its
//           tokens to the draw. Rounding cannot lose the draw: the first thread whose end passes
//           the target wins, and a target past the scanned total takes the last kept token.
// The row's draw depends only on the row (its logits, parameters and uniform), never on the
// batch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kPer = 8;  // consecutive tokens per thread and load
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// Eight consecutive logits from `i` (all in range when `vec`: a 16-byte-aligned row whose length
// is a multiple of 8, read with wide loads), converted to fp32; past the end: -inf.
template <class T>
__device__ __forceinline__ void load8(const T* x, int i, int n, bool vec, float (&v)[8]) {
  if (vec) {
    constexpr int kLoads = sizeof(T) * 8 / 16;
    uint4 raw[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) raw[j] = reinterpret_cast<const uint4*>(x + i)[j];
    const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_f(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = i + j < n ? to_f(x[i + j]) : -INFINITY;
  }
}

// Running (max, sum of exp2(v - max)) pairs, merged.
__device__ __forceinline__ void merge_lse(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * exp2f(m - mx) + s2 * exp2f(m2 - mx);
  m = mx;
}

template <class T>
__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const T* logits, int64_t vocab, int64_t row_stride,
                                                               bool vec, const float* params, int64_t* tokens,
                                                               float* logprobs) {
  __shared__ float s_a[kWarps], s_b[kWarps];
  __shared__ int s_i[kWarps];
  __shared__ int s_token, s_last;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const float temperature = params[3 * row], min_p = params[3 * row + 1], u = params[3 * row + 2];
  const bool greedy = !(temperature > 0.f);
  const float k = (greedy ? 1.f : 1.f / temperature) * kLog2e;  // logits -> log2 units of x / T
  const int n = static_cast<int>(vocab);

  // Pass 1: first maximum, and the log-sum-exp of x / T; two wide loads in flight per thread.
  float best = -INFINITY, m = -INFINITY, s = 0.f;
  int arg = INT_MAX;
  auto visit = [&](int i0, const float (&v)[kPer]) {
    float local = -INFINITY;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (v[e] > best) {
        best = v[e];
        arg = i0 + e;
      }
      local = fmaxf(local, v[e] * k);
    }
    if (local == -INFINITY) return;
    if (local > m) {
      s *= exp2f(m - local);
      m = local;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) s += exp2f(v[e] * k - m);
  };
  for (int i0 = tid * kPer; i0 < n; i0 += 2 * kThreads * kPer) {
    const int i1 = i0 + kThreads * kPer;
    float a[kPer], b[kPer];
    load8(x, i0, n, vec, a);
    if (i1 < n) load8(x, i1, n, vec, b);
    visit(i0, a);
    if (i1 < n) visit(i1, b);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float b2 = __shfl_xor_sync(kFull, best, off);
    const int a2 = __shfl_xor_sync(kFull, arg, off);
    if (b2 > best || (b2 == best && a2 < arg)) {
      best = b2;
      arg = a2;
    }
    merge_lse(m, s, __shfl_xor_sync(kFull, m, off), __shfl_xor_sync(kFull, s, off));
  }
  if (lane == 0) {
    s_a[warp] = m;
    s_b[warp] = s;
    s_i[warp] = arg;
  }
  __syncthreads();
  {
    float wm = -INFINITY, ws = 0.f, wb = -INFINITY;
    int wi = INT_MAX;
    for (int w = 0; w < kWarps; ++w) {
      merge_lse(wm, ws, s_a[w], s_b[w]);
      const int i = s_i[w];
      const float v = i < n ? to_f(x[i]) : -INFINITY;
      if (i < n && (v > wb || (v == wb && i < wi))) {
        wb = v;
        wi = i;
      }
    }
    m = wm;
    s = ws;
    arg = wi < n ? wi : 0;
  }
  const float lse2 = m + log2f(s);  // log2 of the row's partition function
  auto write = [&](int token) {
    if (tid == 0) {
      tokens[row] = token;
      logprobs[row] = (to_f(x[token]) * k - lse2) / kLog2e;
    }
  };
  if (greedy) return write(arg);

  // Kept tokens: z >= m + log2(min_p), i.e. p >= min_p * p_max; their unnormalised weights.
  const float floor2 = min_p > 0.f ? m + log2f(min_p) : -INFINITY;
  auto weights = [&](const float (&v)[kPer], float (&w)[kPer]) {
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const float z = v[e] * k;
      w[e] = z >= floor2 && z != -INFINITY ? exp2f(z - m) : 0.f;
    }
  };
  float total = s;
  if (min_p > 0.f) {  // pass 2
    float t = 0.f;
    for (int i0 = tid * kPer; i0 < n; i0 += kThreads * kPer) {
      float v[kPer], w[kPer];
      load8(x, i0, n, vec, v);
      weights(v, w);
#pragma unroll
      for (int e = 0; e < kPer; ++e) t += w[e];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(kFull, t, off);
    __syncthreads();  // s_a is read above
    if (lane == 0) s_a[warp] = t;
    __syncthreads();
    total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += s_a[w];
  }
  const float target = u * total;

  // Pass 3: scan in token order.
  if (tid == 0) {
    s_token = INT_MAX;
    s_last = -1;
  }
  float running = 0.f;
  int last = -1;  // this thread's last kept token
  float next[kPer];  // the next tile's logits, loaded while this tile is scanned
  if (tid * kPer < n) load8(x, tid * kPer, n, vec, next);
  for (int start = 0; start < n; start += kThreads * kPer) {
    const int i0 = start + tid * kPer;
    float v[kPer], w[kPer], mine = 0.f;
#pragma unroll
    for (int e = 0; e < kPer; ++e) v[e] = i0 < n ? next[e] : -INFINITY;
    if (i0 + kThreads * kPer < n) load8(x, i0 + kThreads * kPer, n, vec, next);
    weights(v, w);
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      mine += w[e];
      if (w[e] > 0.f) last = i0 + e;
    }
    float incl = mine;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float up = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += up;
    }
    __syncthreads();  // the previous tile's reads of s_b are done
    if (lane == 31) s_b[warp] = incl;
    __syncthreads();
    float before = running;  // mass before this warp
    for (int wi = 0; wi < warp; ++wi) before += s_b[wi];
    float tile = 0.f;
    for (int wi = 0; wi < kWarps; ++wi) tile += s_b[wi];
    const float begin = before + (incl - mine);
    if (mine > 0.f && begin + mine > target) {
      float c = begin;
      int pick = -1;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        if (w[e] <= 0.f) continue;
        pick = i0 + e;  // the last kept one if rounding keeps c at or below the target
        c += w[e];
        if (c > target) break;
      }
      atomicMin(&s_token, pick);
    }
    __syncthreads();
    if (s_token != INT_MAX) break;
    running += tile;
  }
  if (last >= 0) atomicMax(&s_last, last);
  __syncthreads();
  write(s_token != INT_MAX ? s_token : (s_last >= 0 ? s_last : arg));
}

}  // namespace

void sample_rows(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                 const float* params, int64_t* tokens, float* logprobs, void* stream) {
  if (rows == 0) return;
  if (vocab <= 0 || vocab >= INT_MAX) throw std::invalid_argument("sample_rows: vocab " + std::to_string(vocab));
  const auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>(rows);
  const int64_t bytes = dtype == DType::kFloat ? 4 : 2;
  const bool vec = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && (row_stride * bytes) % 16 == 0 && vocab % 8 == 0;
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    sample_rows_kernel<<<grid, kThreads, 0, s>>>(static_cast<const T*>(logits), vocab, row_stride, vec, params, tokens,
                                                 logprobs);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("sampler launch: ") + cudaGetErrorString(err));
}

}  // namespace tiller::model::cuda
