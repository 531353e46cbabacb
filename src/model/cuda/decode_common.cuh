// Device code shared by the two decode-attention kernels (paged_attention.cu: CUDA cores, every
// dtype and head size; paged_decode_mma.cu: tensor cores for bf16/fp16 query-head groups): the
// cp.async helpers, the merge of a thread block's partial softmax states into its split's
// result, and the kernel that combines the splits. CUDA translation units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "model/cuda/paged_attention.h"

namespace tiller::model::cuda::detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxSplits = 16;

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + " launch: " + cudaGetErrorString(err));
}

__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool fill) {
  // 16 bytes global -> shared without registers; fill false writes zeros instead (no read).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(fill ? 16 : 0));
}
// 8 and 4 bytes the same way (an FP8 cache's row share and its scale).
__device__ __forceinline__ void cp_async8(uint32_t smem, const void* gmem, bool fill) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem), "l"(gmem), "r"(fill ? 8 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t smem, const void* gmem, bool fill) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(fill ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The keys [lo, hi) of one split of sequence b: the window's start, then equal shares of
// `align` keys each (a split may be empty).
struct SplitRange {
  int lo = 0, hi = 0;
};
__device__ __forceinline__ SplitRange split_range(const PagedDecode& a, int b, int split, int align) {
  const int len = a.seq_lens[b];
  const int start = a.window > 0 ? max(0, len - static_cast<int>(a.window)) : 0;
  const int splits = static_cast<int>(a.splits);
  int per = (len - start + splits - 1) / splits;
  per = (per + align - 1) / align * align;
  SplitRange r;
  r.lo = min(len, start + split * per);
  r.hi = min(len, r.lo + per);
  return r;
}

// Merges a thread block's `parts` partial states of each of its query heads — running max m and
// sum l (log2 units) and the unnormalised output acc, in shared memory as m[part * stride + g],
// l[...] and acc[(part * stride + g) * D + d] — and writes the split's result: the output itself
// when there is one split, else the split's normalised output and log-sum-exp in the workspace.
// Every thread of the block calls it.
// Row g, column d of that merge: the maximum mx, the normaliser sum and the unnormalised output
// o over the parts, in part order. One definition for the decode kernels and the bitwise prefill
// (paged_decode_prefill), so that they round alike.
template <int D>
__device__ __forceinline__ void merge_parts(const float* s_m, const float* s_l, const float* s_acc, int parts,
                                            int stride, int g, int d, float& mx, float& sum, float& o) {
  mx = -INFINITY;
  for (int p = 0; p < parts; ++p) mx = fmaxf(mx, s_m[p * stride + g]);
  sum = 0.f;
  o = 0.f;
  if (mx != -INFINITY)
    for (int p = 0; p < parts; ++p) {
      const float m = s_m[p * stride + g];
      if (m == -INFINITY) continue;
      const float w = exp2f(m - mx);
      sum = fmaf(s_l[p * stride + g], w, sum);
      o = fmaf(s_acc[(p * stride + g) * D + d], w, o);
    }
}

template <class T, int D>
__device__ void store_merged(const PagedDecode& a, const float* s_m, const float* s_l, const float* s_acc, int parts,
                             int stride, int heads_here, int head0, int b, int split) {
  const int splits = static_cast<int>(a.splits);
  float* ws_o = a.workspace;
  float* ws_lse = a.workspace + a.batch * a.heads * splits * D;
  for (int idx = threadIdx.x; idx < heads_here * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float mx, sum, o;
    merge_parts<D>(s_m, s_l, s_acc, parts, stride, g, d, mx, sum, o);
    const float out = sum > 0.f ? o / sum : 0.f;
    const int64_t bh = static_cast<int64_t>(b) * a.heads + head0 + g;
    if (splits == 1) {
      store(static_cast<T*>(a.out) + bh * D + d, out);
    } else {
      ws_o[(bh * splits + split) * D + d] = out;
      if (d == 0) ws_lse[bh * splits + split] = sum > 0.f ? mx + log2f(sum) : -INFINITY;
    }
  }
}

// One thread block per (sequence, query head): the splits weighted by their log-sum-exp.
template <class T>
__global__ void combine_kernel(PagedDecode a) {
  const int64_t bh = blockIdx.x, splits = a.splits, dim = a.head_dim;
  const float* ws_o = a.workspace;
  const float* lse = a.workspace + a.batch * a.heads * splits * dim + bh * splits;
  float mx = -INFINITY;
  for (int64_t s = 0; s < splits; ++s) mx = fmaxf(mx, lse[s]);
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float sum = 0.f, o = 0.f;
    if (mx != -INFINITY)
      for (int64_t s = 0; s < splits; ++s) {
        if (lse[s] == -INFINITY) continue;
        const float w = exp2f(lse[s] - mx);
        sum += w;
        o = fmaf(w, ws_o[(bh * splits + s) * dim + d], o);
      }
    store(static_cast<T*>(a.out) + bh * dim + d, sum > 0.f ? o / sum : 0.f);
  }
}

template <class T>
void launch_combine(const PagedDecode& a, cudaStream_t stream) {
  if (a.splits <= 1) return;
  combine_kernel<T><<<static_cast<unsigned>(a.batch * a.heads),
                      static_cast<unsigned>(a.head_dim < 128 ? a.head_dim : 128), 0, stream>>>(a);
  check_launch("paged decode combine");
}

// The tensor-core kernel (paged_decode_mma.cu): bf16/fp16, head sizes 64 and 128, 2 to 16 query
// heads per KV head. paged_decode_mma launches it (and the combine) and returns true, or returns
// false when the shape is not one it serves. paged_decode_prefill_mma (paged_prefill_mma.cu) runs its
// bitwise prefill form.
bool paged_decode_mma_serves(DType dtype, int64_t head_dim, int64_t group);
bool paged_decode_mma(const PagedDecode& a, cudaStream_t stream);
void paged_decode_prefill_mma(const PrefillRows& a, cudaStream_t stream);

}  // namespace tiller::model::cuda::detail
