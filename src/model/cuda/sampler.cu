// The sampler's one-kernel path (kernels.h: sample_rows): one thread block per row of logits,
// each warp over its own contiguous sixteenth of the row, read with coalesced 16-byte loads
// (three in flight per lane).
//   pass 1  the first maximum of the logits (greedy), the row's log-sum-exp of x / T in log2
//           units, and the (max, sum) of every chunk of the warp's range (at most 64 chunks of
//           512 or more tokens a warp);
//   pass 2  (only with min_p) every chunk's kept mass: tokens with p >= min_p * p_max;
//   search  one warp finds the first warp range, then its first chunk, then in that chunk (read
//           again) the first token whose running mass passes u times the total, from prefix sums
//           of the masses in token order. A target that rounding puts past a level's total takes
//           that level's last kept token, as a target past the row's total takes its last one.
// The draw is the inverse-CDF draw of the ATen sampler; it reads the row about once instead of a
// block-wide scan with two barriers per 4096 tokens. The row's draw depends only on the row
// (its logits, parameters and uniform), never on the batch.
// Pass 1 (warp_lse, then the warps merged in order) is also the bitwise mode's log-prob head
// (invariant_logprobs, below): the log-prob this kernel reports for its draw is that kernel's.
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
constexpr int kPer = 8;             // consecutive tokens per lane and load
constexpr int kStep = 32 * kPer;    // tokens per warp load
constexpr int kMaxChunks = 64;      // per warp range
constexpr int kMinChunk = 2 * kStep;
constexpr int kMaxVocab = 1 << 30;  // int token indices with room to spare
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// Eight consecutive tokens' logits as raw 16-byte words (the row is only 16-byte aligned).
template <class T>
struct Vec {
  static constexpr int kWords = static_cast<int>(sizeof(T)) * kPer / 16;
  uint4 w[kWords];
  __device__ __forceinline__ T get(int e) const { return reinterpret_cast<const T*>(w)[e]; }
  __device__ __forceinline__ void set(int e, T v) { reinterpret_cast<T*>(w)[e] = v; }
};

// Tokens [i, i + 8) that lie below `hi`; -inf past it. Wide loads when `vec` (a 16-byte-aligned
// row whose length is a multiple of 8; every range bound is then a multiple of 8 as well).
template <class T>
__device__ __forceinline__ Vec<T> load8(const T* x, int i, int hi, bool vec) {
  Vec<T> r;
  if (vec && i + kPer <= hi) {
#pragma unroll
    for (int j = 0; j < Vec<T>::kWords; ++j) r.w[j] = reinterpret_cast<const uint4*>(x + i)[j];
    return r;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) r.set(j, i + j < hi ? x[i + j] : from_f<T>(-INFINITY));
  return r;
}

// Running (max m, sum s of exp2(z - m)) pairs in log2 units, merged; with kEntropy also w, the sum
// of exp2(z - m) (z - m) (the entropy's numerator). Every product and sum is rounded on its own
// (__fmul_rn, __fadd_rn: never contracted into an FMA), so that the sampler and the bitwise
// mode's log-prob kernel, which inline these into different kernels, compute the same bits.
template <bool kEntropy = false>
__device__ __forceinline__ void merge_lse(float& m, float& s, float& w, float m2, float s2, float w2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  const float f = exp2f(m - mx), f2 = exp2f(m2 - mx);
  if constexpr (kEntropy) {
    const float a = s > 0.f ? __fmul_rn(f, __fadd_rn(w, __fmul_rn(s, m - mx))) : 0.f;
    const float b = s2 > 0.f ? __fmul_rn(f2, __fadd_rn(w2, __fmul_rn(s2, m2 - mx))) : 0.f;
    w = __fadd_rn(a, b);
  }
  s = __fadd_rn(__fmul_rn(s, f), __fmul_rn(s2, f2));
  m = mx;
}
__device__ __forceinline__ void merge_lse(float& m, float& s, float m2, float s2) {
  float w = 0.f;
  merge_lse<false>(m, s, w, m2, s2, 0.f);
}

// The warp's tokens [lo, hi) in steps of kStep (lane l takes tokens l * 8 .. l * 8 + 7 of each),
// three loads in flight: f(step, first token of the lane, its 8 values in fp32).
template <class T, class F>
__device__ __forceinline__ void stream_range(const T* x, int lo, int hi, bool vec, int lane, F&& f) {
  const int steps = hi > lo ? (hi - lo + kStep - 1) / kStep : 0;
  auto at = [&](int s) { return lo + s * kStep + lane * kPer; };
  Vec<T> a, b, c;
  if (steps > 0) a = load8(x, at(0), hi, vec);
  if (steps > 1) b = load8(x, at(1), hi, vec);
  if (steps > 2) c = load8(x, at(2), hi, vec);
  for (int s = 0; s < steps; ++s) {
    const Vec<T> cur = a;
    a = b;
    b = c;
    if (s + 3 < steps) c = load8(x, at(s + 3), hi, vec);
    float v[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) v[e] = to_f(cur.get(e));
    f(s, at(s), v);
  }
}

// The first lane (in lane order) whose inclusive prefix `incl` of `mass` passes `target`, or -1.
__device__ __forceinline__ int first_past(float mass, float incl, float target) {
  const unsigned hit = __ballot_sync(kFull, mass > 0.f && incl > target);
  return hit ? __ffs(hit) - 1 : -1;
}

__device__ __forceinline__ float inclusive_scan(float v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float up = __shfl_up_sync(kFull, v, off);
    if (lane >= off) v += up;
  }
  return v;
}

// A row's ranges: warp w takes a contiguous range of a multiple of 8 tokens, cut into chunks of a
// multiple of kStep tokens (at most kMaxChunks a warp). Depends on the vocabulary alone.
struct RowLayout {
  int n, per, chunk, steps_per_chunk;
  __device__ explicit RowLayout(int vocab) : n(vocab) {
    per = ((n + kWarps - 1) / kWarps + kPer - 1) / kPer * kPer;
    chunk = (per + kMaxChunks - 1) / kMaxChunks;
    chunk = max(kMinChunk, (chunk + kStep - 1) / kStep * kStep);
    steps_per_chunk = chunk / kStep;
  }
  __device__ int lo(int w) const { return min(n, w * per); }
  __device__ int hi(int w) const { return min(n, lo(w) + per); }
  __device__ int chunks(int w) const { return (hi(w) - lo(w) + chunk - 1) / chunk; }
};

// log2(e) / temperature: logits -> log2 units of x / T (a temperature <= 0, greedy, counts as 1).
__device__ __forceinline__ float log2_scale(float temperature) {
  return temperature > 0.f ? __fmul_rn(__fdiv_rn(1.f, temperature), kLog2e) : kLog2e;
}
// log softmax(x / T)[token] from the token's logit, the scale and the row's log2 partition function.
__device__ __forceinline__ float logprob_of(float x, float k, float lse2) {
  return __fdiv_rn(__fsub_rn(__fmul_rn(x, k), lse2), kLog2e);
}

// Pass 1 of one warp over its range [lo, hi) of a row: each lane's running (max, sum) of z = x k
// over its tokens, the warp's pairs merged at the end of every chunk (lane order of the butterfly,
// then the chunks in order) into the warp's (wm, ws) (and ww with kEntropy). value(i, x) sees every
// token first (the sampler's argmax); chunk(c, cm, cs) every chunk's warp-wide pair.
template <bool kEntropy, class T, class Value, class Chunk>
__device__ __forceinline__ void warp_lse(const T* x, int lo, int hi, int steps_per_chunk, bool vec, int lane, float k,
                                         float& wm, float& ws, float& ww, Value&& value, Chunk&& chunk) {
  float lm = -INFINITY, ls = 0.f, lw = 0.f;  // this lane's share of the current chunk
  wm = -INFINITY;
  ws = ww = 0.f;
  const int steps = hi > lo ? (hi - lo + kStep - 1) / kStep : 0;
  stream_range(x, lo, hi, vec, lane, [&](int s, int i0, const float (&v)[kPer]) {
    float local = -INFINITY;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      value(i0 + e, v[e]);
      local = fmaxf(local, __fmul_rn(v[e], k));
    }
    if (local != -INFINITY) {
      if (local > lm) {
        const float f = exp2f(lm - local);
        if constexpr (kEntropy) lw = ls > 0.f ? __fmul_rn(f, __fadd_rn(lw, __fmul_rn(ls, lm - local))) : 0.f;
        ls = __fmul_rn(ls, f);
        lm = local;
      }
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const float d = __fmul_rn(v[e], k) - lm, p = exp2f(d);
        ls = __fadd_rn(ls, p);
        if constexpr (kEntropy) lw = p > 0.f ? __fadd_rn(lw, __fmul_rn(p, d)) : lw;
      }
    }
    if ((s + 1) % steps_per_chunk == 0 || s + 1 == steps) {  // warp-uniform: the chunk ends
      float cm = lm, cs = ls, cw = lw;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        merge_lse<kEntropy>(cm, cs, cw, __shfl_xor_sync(kFull, cm, off), __shfl_xor_sync(kFull, cs, off),
                            __shfl_xor_sync(kFull, cw, off));
      chunk(s / steps_per_chunk, cm, cs);
      merge_lse<kEntropy>(wm, ws, ww, cm, cs, cw);
      lm = -INFINITY;
      ls = lw = 0.f;
    }
  });
}

template <class T>
__global__ void __launch_bounds__(kThreads, 2) sample_rows_kernel(const T* logits, int vocab, int64_t row_stride,
                                                               bool vec, const float* params, int64_t* tokens,
                                                               float* logprobs) {
  __shared__ float s_cm[kWarps][kMaxChunks], s_cs[kWarps][kMaxChunks];  // chunk (max, sum), then mass
  __shared__ float s_wm[kWarps], s_ws[kWarps], s_best[kWarps], s_wmass[kWarps];
  __shared__ int s_arg[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const float temperature = params[3 * row], min_p = params[3 * row + 1], u = params[3 * row + 2];
  const bool greedy = !(temperature > 0.f);
  const float k = log2_scale(temperature);  // logits -> log2 units of x / T
  const RowLayout layout(vocab);
  const int n = vocab, chunk = layout.chunk, steps_per_chunk = layout.steps_per_chunk;
  auto range_lo = [&](int w) { return layout.lo(w); };
  auto range_hi = [&](int w) { return layout.hi(w); };
  auto chunks_of = [&](int w) { return layout.chunks(w); };
  const int lo = range_lo(warp), hi = range_hi(warp), chunks = chunks_of(warp);

  // Pass 1.
  float best = -INFINITY;
  int arg = INT_MAX;
  float wm, ws, ww;  // the warp's chunks
  const int steps = hi > lo ? (hi - lo + kStep - 1) / kStep : 0;
  warp_lse<false>(
      x, lo, hi, steps_per_chunk, vec, lane, k, wm, ws, ww,
      [&](int i, float v) {
        if (v > best) {  // a lane's tokens come in increasing order: the first maximum stays
          best = v;
          arg = i;
        }
      },
      [&](int c, float cm, float cs) {
        if (lane == 0) {
          s_cm[warp][c] = cm;
          s_cs[warp][c] = cs;
        }
      });
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float b2 = __shfl_xor_sync(kFull, best, off);
    const int a2 = __shfl_xor_sync(kFull, arg, off);
    if (b2 > best || (b2 == best && a2 < arg)) {
      best = b2;
      arg = a2;
    }
  }
  if (lane == 0) {
    s_wm[warp] = wm;
    s_ws[warp] = ws;
    s_best[warp] = best;
    s_arg[warp] = arg;
  }
  __syncthreads();
  float m = -INFINITY, s = 0.f;
  {
    float wb = -INFINITY;
    int wi = INT_MAX;
    for (int w = 0; w < kWarps; ++w) {  // ranges in token order: the first maximum wins ties
      merge_lse(m, s, s_wm[w], s_ws[w]);
      if (s_arg[w] < n && s_best[w] > wb) {
        wb = s_best[w];
        wi = s_arg[w];
      }
    }
    arg = wi < n ? wi : 0;
  }
  const float lse2 = __fadd_rn(m, log2f(s));  // log2 of the row's partition function
  auto write = [&](int token) {
    tokens[row] = token;
    logprobs[row] = logprob_of(to_f(x[token]), k, lse2);
  };
  if (greedy) {
    if (threadIdx.x == 0) write(arg);
    return;
  }

  // Every chunk's mass (kept tokens only: z >= m + log2(min_p), i.e. p >= min_p * p_max).
  const float floor2 = min_p > 0.f ? m + log2f(min_p) : -INFINITY;
  auto weight = [&](float v) {
    const float z = v * k;
    return z >= floor2 && z != -INFINITY ? exp2f(z - m) : 0.f;
  };
  if (min_p > 0.f) {  // pass 2
    float part = 0.f;
    stream_range(x, lo, hi, vec, lane, [&](int st, int, const float (&v)[kPer]) {
#pragma unroll
      for (int e = 0; e < kPer; ++e) part += weight(v[e]);
      if ((st + 1) % steps_per_chunk == 0 || st + 1 == steps) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(kFull, part, off);
        if (lane == 0) s_cs[warp][st / steps_per_chunk] = part;
        part = 0.f;
      }
    });
    __syncwarp();
  } else {
    for (int c = lane; c < chunks; c += 32) {
      const float cm = s_cm[warp][c];
      s_cs[warp][c] = cm == -INFINITY ? 0.f : s_cs[warp][c] * exp2f(cm - m);
    }
    __syncwarp();
  }
  {
    float t = 0.f;
    for (int c = lane; c < chunks; c += 32) t += s_cs[warp][c];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(kFull, t, off);
    if (lane == 0) s_wmass[warp] = t;
  }
  __syncthreads();
  if (warp != 0) return;

  // The search, by warp 0. `past`: rounding put the target past a level's total; every level
  // below then takes its last kept token.
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += s_wmass[w];
  float target = u * total;
  float base = 0.f;
  int sel_w = -1;
  {
    const float mass = lane < kWarps ? s_wmass[lane] : 0.f;
    const float incl = inclusive_scan(mass, lane);
    sel_w = first_past(mass, base + incl, target);
    if (sel_w < 0) {
      const unsigned nz = __ballot_sync(kFull, mass > 0.f);
      if (!nz) {
        if (lane == 0) write(arg);  // no kept mass at all (every logit -inf)
        return;
      }
      sel_w = 31 - __clz(nz);
      target = INFINITY;
    }
    base += __shfl_sync(kFull, incl - mass, sel_w);
  }
  int sel_c = -1;
  {
    const int nc = chunks_of(sel_w);
    int last_nz = -1;
    for (int c0 = 0; c0 < nc && sel_c < 0; c0 += 32) {
      const float mass = c0 + lane < nc ? s_cs[sel_w][c0 + lane] : 0.f;
      const float incl = inclusive_scan(mass, lane);
      const int hit = first_past(mass, base + incl, target);
      const unsigned nz = __ballot_sync(kFull, mass > 0.f);
      if (nz) last_nz = c0 + 31 - __clz(nz);
      if (hit >= 0) {
        sel_c = c0 + hit;
        base += __shfl_sync(kFull, incl - mass, hit);
      } else {
        base += __shfl_sync(kFull, incl, 31);
      }
    }
    if (sel_c < 0) {
      sel_c = last_nz >= 0 ? last_nz : 0;
      target = INFINITY;
    }
  }
  // The token in the chosen chunk, its weights computed again from the logits.
  const int c_lo = range_lo(sel_w) + sel_c * chunk, c_hi = min(range_hi(sel_w), c_lo + chunk);
  int token = -1, last = -1;
  for (int i0 = c_lo; i0 < c_hi && token < 0; i0 += kStep) {
    const int mine_at = i0 + lane * kPer;
    const Vec<T> raw = load8(x, mine_at, c_hi, vec);
    float w[kPer], mine = 0.f;
    int my_last = -1;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      w[e] = weight(to_f(raw.get(e)));
      mine += w[e];
      if (w[e] > 0.f) my_last = mine_at + e;
    }
    const float incl = inclusive_scan(mine, lane);
    const int hit = first_past(mine, base + incl, target);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) my_last = max(my_last, __shfl_xor_sync(kFull, my_last, off));
    last = max(last, my_last);
    if (hit >= 0) {
      int pick = -1;
      if (lane == hit) {
        float c = base + incl - mine;
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          if (w[e] <= 0.f) continue;
          pick = mine_at + e;  // the last kept one if rounding keeps c at or below the target
          c += w[e];
          if (c > target) break;
        }
      }
      token = __shfl_sync(kFull, pick, hit);
    } else {
      base += __shfl_sync(kFull, incl, 31);
    }
  }
  if (lane == 0) write(token >= 0 ? token : last >= 0 ? last : arg);
}

// algo.logprob_match = bitwise (kernels.h: invariant_logprobs): log softmax(x / T)[target] of a
// row by the sampler's own pass 1 (warp_lse, the warps merged in order), so that the log-prob the
// sampler reports for its draw is this kernel's for the same row and temperature, bit for bit,
// and the engine need not compute it again. With `entropy`, the entropy from the same pass.
template <class T>
__global__ void __launch_bounds__(kThreads, 2) lse_logprob_rows_kernel(const T* logits, int vocab, int64_t row_stride,
                                                                    bool vec, const int64_t* targets,
                                                                    const float* temperatures, bool per_row,
                                                                    float* logprobs, float* entropy) {
  __shared__ float s_wm[kWarps], s_ws[kWarps], s_ww[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const float k = log2_scale(temperatures[per_row ? row : 0]);
  const RowLayout layout(vocab);
  float wm, ws, ww;
  auto none = [](auto...) {};
  if (entropy)
    warp_lse<true>(x, layout.lo(warp), layout.hi(warp), layout.steps_per_chunk, vec, lane, k, wm, ws, ww, none, none);
  else
    warp_lse<false>(x, layout.lo(warp), layout.hi(warp), layout.steps_per_chunk, vec, lane, k, wm, ws, ww, none, none);
  if (lane == 0) {
    s_wm[warp] = wm;
    s_ws[warp] = ws;
    s_ww[warp] = ww;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  float m = -INFINITY, s = 0.f, w = 0.f;
  for (int i = 0; i < kWarps; ++i) {
    float m1 = m, s1 = s;
    merge_lse(m, s, s_wm[i], s_ws[i]);  // the sampler's merge
    if (entropy) merge_lse<true>(m1, s1, w, s_wm[i], s_ws[i], s_ww[i]);
  }
  const float lse2 = __fadd_rn(m, log2f(s));
  const int64_t target = targets[row];
  logprobs[row] = target >= 0 && target < vocab ? logprob_of(to_f(x[target]), k, lse2) : NAN;
  if (entropy) entropy[row] = s > 0.f ? (log2f(s) - w / s) * 0.6931471805599453f : NAN;
}

}  // namespace

void invariant_logprobs(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                        const int64_t* targets, const float* temperatures, bool per_row, float* logprobs,
                        float* entropy, void* stream) {
  if (rows == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("invariant log-probs: more than 2^31 - 1 rows");
  if (vocab <= 0 || vocab > kMaxVocab)
    throw std::invalid_argument("invariant log-probs: vocabulary of " + std::to_string(vocab) + " tokens (1 to 2^30)");
  const int64_t bytes = dtype == DType::kFloat ? 4 : 2;
  const bool vec = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && (row_stride * bytes) % 16 == 0 && vocab % 8 == 0;
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    lse_logprob_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(logits), static_cast<int>(vocab), row_stride, vec, targets, temperatures, per_row,
        logprobs, entropy);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("invariant log-probs launch: ") + cudaGetErrorString(err));
}

void sample_rows(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                 const float* params, int64_t* tokens, float* logprobs, void* stream) {
  if (rows == 0) return;
  if (vocab <= 0 || vocab > kMaxVocab)
    throw std::invalid_argument("sample_rows: vocabulary of " + std::to_string(vocab) + " tokens (1 to 2^30)");
  const auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>(rows);
  const int64_t bytes = dtype == DType::kFloat ? 4 : 2;
  const bool vec = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && (row_stride * bytes) % 16 == 0 && vocab % 8 == 0;
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    sample_rows_kernel<<<grid, kThreads, 0, s>>>(static_cast<const T*>(logits), static_cast<int>(vocab), row_stride,
                                                 vec, params, tokens, logprobs);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("sampler launch: ") + cudaGetErrorString(err));
}

}  // namespace tiller::model::cuda
