// Decode attention over the paged KV cache (split-KV flash decoding) and the decode step's cache
// write. See paged_attention.h for the layout and the contract.
//
// Work split of paged_decode_kernel: a thread block of 128 threads serves one (sequence, KV head,
// chunk of <= 4 query heads, split). Each K/V row is read by kLanes = head_dim / 8 lanes, 8
// elements (16 bytes in bf16) each, so 128 / kLanes row groups work side by side, two rows each
// per iteration, and every row serves all the block's query heads. K/V arrive in shared memory
// through a cp.async pipeline; each row group keeps its own online softmax (log2 domain) in
// registers, and the groups are merged through shared memory at the end.
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "model/cuda/decode_common.cuh"
#include "model/cuda/paged_attention.h"
#include "model/cuda/convert.cuh"

namespace tiller::model::cuda {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace): this file's own helpers

constexpr int kThreads = 128;
constexpr int kVec = 8;        // elements per lane of a K/V row
constexpr int kMaxGroup = 4;   // query heads per thread block

// The element type of an FP8 KV cache (PagedDecode::cache_fp8): e4m3 codes, one scale per row.
struct E4m3 {};

// A lane's 8 elements of a row as loaded (16 bytes, or 32 in fp32), converted to fp32 when used,
// so that the loads of two rows are in flight together without holding 32 floats.
template <class T>
struct Raw8 {
  uint4 w[sizeof(T) * kVec / 16];
};
// From an FP8 cache: 8 codes and the row's scale (16 bytes with the padding, as a bf16 share).
template <>
struct Raw8<E4m3> {
  uint2 w;
  float scale;
  float pad;
};
template <class T>
__device__ __forceinline__ void load_raw(const T* p, Raw8<T>& r) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(r.w) / 16); ++i) r.w[i] = reinterpret_cast<const uint4*>(p)[i];
}
__device__ __forceinline__ void to_float(const Raw8<__nv_bfloat16>& r, float* f) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&r.w[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void to_float(const Raw8<__half>& r, float* f) {
  const auto* h = reinterpret_cast<const __half2*>(&r.w[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void to_float(const Raw8<float>& r, float* f) {
  const auto* x = reinterpret_cast<const float*>(&r.w[0]);
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] = x[i];
}

// A cached share as the values attention reads: the cache's own elements, or an FP8 cache's codes
// times the row's scale rounded to the compute type T (model::fp8::dequantize_rows).
template <class T>
__device__ __forceinline__ void to_float_as(const Raw8<T>& r, float* f) {
  to_float(r, f);
}
template <class T>
__device__ __forceinline__ void to_float_as(const Raw8<E4m3>& r, float* f) {
  const auto* b = reinterpret_cast<const __nv_fp8_storage_t*>(&r.w);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float x = __half2float(__half(__nv_cvt_fp8_to_halfraw(b[i], __NV_E4M3)));
    f[i] = model::cuda::to_f(model::cuda::from_f<T>(x * r.scale));
  }
}

template <class T>
__device__ __forceinline__ void load8(const T* p, float* f) {
  Raw8<T> r;
  load_raw(p, r);
  to_float(r, f);
}

template <int kLanes, int G>
__device__ __forceinline__ void warp_sum(float (&s)[G]) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1)
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] += __shfl_xor_sync(0xffffffffu, s[g], off);
}

template <int G>
__device__ __forceinline__ void dot(const float (&q)[G][kVec], const float (&k)[kVec], float (&s)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float d = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) d = fmaf(q[g][i], k[i], d);
    s[g] = d;
  }
}

// Two K/V rows (a, b) into a row group's online softmax, one rescale for both. Every lane of the
// warp calls this (the shuffles span the warp); invalid rows only join the shuffles. Rows past
// the end were zero-filled, so their V contributes 0 * 0.
template <int kLanes, int G, class T, class C>
__device__ __forceinline__ void attend_pair(bool ok_a, bool ok_b, const Raw8<C>& ka, const Raw8<C>& va,
                                            const Raw8<C>& kb, const Raw8<C>& vb, const float (&q)[G][kVec],
                                            float (&acc)[G][kVec], float (&m)[G], float (&l)[G]) {
  float k[kVec], sa[G], sb[G];
  to_float_as<T>(ka, k);
  dot<G>(q, k, sa);
  to_float_as<T>(kb, k);
  dot<G>(q, k, sb);
  warp_sum<kLanes, G>(sa);
  warp_sum<kLanes, G>(sb);
  if (!ok_a && !ok_b) return;
  float fa[kVec], fb[kVec];
  to_float_as<T>(va, fa);
  to_float_as<T>(vb, fb);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float xa = ok_a ? sa[g] : -INFINITY, xb = ok_b ? sb[g] : -INFINITY;
    const float mn = fmaxf(m[g], fmaxf(xa, xb));
    const float alpha = exp2f(m[g] - mn), pa = exp2f(xa - mn), pb = exp2f(xb - mn);
    l[g] = fmaf(l[g], alpha, pa + pb);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[g][i] = fmaf(pb, fb[i], fmaf(pa, fa[i], acc[g][i] * alpha));
    m[g] = mn;
  }
}

// C: the cache's element type, T or E4m3.
template <class T, class C, int D, int G>
__global__ void __launch_bounds__(kThreads, 4) paged_decode_kernel(PagedDecode a) {
  constexpr bool kFp8 = std::is_same_v<C, E4m3>;
  using Elem = std::conditional_t<kFp8, uint8_t, T>;
  constexpr int kLanes = D / kVec;            // lanes per K/V row
  constexpr int kRows = kThreads / kLanes;    // rows in flight (row groups)
  const int group = static_cast<int>(a.heads / a.kv_heads);
  const int chunks = (group + G - 1) / G;
  const int kv_head = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const int b = blockIdx.y, split = blockIdx.z;
  const int head0 = kv_head * group + chunk * G;
  const int heads_here = min(G, group - chunk * G);
  const int tid = threadIdx.x, rg = tid / kLanes, lane = tid % kLanes;
  const SplitRange range = split_range(a, b, split, 1);
  const int lo = range.lo, hi = range.hi;

  float q[G][kVec], acc[G][kVec], m[G], l[G];
  const T* qp = static_cast<const T*>(a.q) + b * a.q_token_stride + static_cast<int64_t>(head0) * D + lane * kVec;
  const float qscale = a.scale * kLog2e;  // scores in log2 units: exp2 below
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g < heads_here) load8(qp + g * D, q[g]);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      q[g][i] = g < heads_here ? q[g][i] * qscale : 0.f;
      acc[g][i] = 0.f;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }

  const int32_t* blocks = a.key_base ? nullptr : a.blocks + a.offsets[b];
  const int64_t key0 = a.key_base ? a.key_base[b] : 0;
  const int64_t row = a.kv_heads * D, bs = a.block_size;
  const Elem* kc = static_cast<const Elem*>(a.k_cache) + kv_head * D + lane * kVec;
  const Elem* vc = static_cast<const Elem*>(a.v_cache) + kv_head * D + lane * kVec;
  const float* ks = kFp8 ? a.k_scale + kv_head : nullptr;  // row s's scale at [s * kv_heads]
  const float* vs = kFp8 ? a.v_scale + kv_head : nullptr;

  // Each iteration takes two rows per row group. Their K/V reach shared memory through a
  // kStages-deep cp.async pipeline: each lane copies exactly the bytes it later reads, so no
  // barrier is needed, and the loads of later iterations (and their block ids) are in flight
  // while this one computes. After the loop the same shared memory holds the merge.
  constexpr int kStages = sizeof(Raw8<C>) == 32 ? 2 : 4;
  constexpr int kChunks = sizeof(Raw8<C>) / 16;
  constexpr int kStageBytes = kStages * 4 * kThreads * static_cast<int>(sizeof(Raw8<C>));
  constexpr int kMergeBytes = kRows * G * (D + 2) * 4;
  __shared__ __align__(16) unsigned char smem[kStageBytes > kMergeBytes ? kStageBytes : kMergeBytes];
  auto* stage = reinterpret_cast<Raw8<C>*>(smem);  // [stage][row a|b][K|V][thread]
  auto at = [&](int st, int r, int kv) { return stage + ((st * 2 + r) * 2 + kv) * kThreads + tid; };
  const int iters = hi > lo ? (hi - lo + 2 * kRows - 1) / (2 * kRows) : 0;
  auto locate = [&](int it, int r, bool& ok) -> int64_t {
    const int t = lo + it * 2 * kRows + r * kRows + rg;
    ok = it < iters && t < hi;
    return !ok ? 0 : blocks ? static_cast<int64_t>(blocks[t / bs]) * bs + t % bs : key0 + t;
  };
  auto issue = [&](int it, int64_t slot_a, bool ok_a, int64_t slot_b, bool ok_b) {
    const int st = it % kStages;
    if constexpr (kFp8) {  // the row's 8 codes and its scale
      auto put = [&](int r, int kv, const uint8_t* codes, const float* scale, bool ok) {
        const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(at(st, r, kv)));
        cp_async8(to, codes, ok);
        cp_async4(to + 8, scale, ok);
      };
      put(0, 0, kc + slot_a * row, ks + slot_a * a.kv_heads, ok_a);
      put(0, 1, vc + slot_a * row, vs + slot_a * a.kv_heads, ok_a);
      put(1, 0, kc + slot_b * row, ks + slot_b * a.kv_heads, ok_b);
      put(1, 1, vc + slot_b * row, vs + slot_b * a.kv_heads, ok_b);
    } else {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        constexpr int kPer = 16 / sizeof(T);
        cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(at(st, 0, 0))) + 16 * c, kc + slot_a * row + c * kPer, ok_a);
        cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(at(st, 0, 1))) + 16 * c, vc + slot_a * row + c * kPer, ok_a);
        cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(at(st, 1, 0))) + 16 * c, kc + slot_b * row + c * kPer, ok_b);
        cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(at(st, 1, 1))) + 16 * c, vc + slot_b * row + c * kPer, ok_b);
      }
    }
    cp_async_commit();
  };
  bool ok_a, ok_b;
  int64_t slot_a = locate(0, 0, ok_a), slot_b = locate(0, 1, ok_b);
  for (int it = 0; it < kStages - 1; ++it) {
    issue(it, slot_a, ok_a, slot_b, ok_b);
    slot_a = locate(it + 1, 0, ok_a);
    slot_b = locate(it + 1, 1, ok_b);
  }
  for (int it = 0; it < iters; ++it) {
    issue(it + kStages - 1, slot_a, ok_a, slot_b, ok_b);
    slot_a = locate(it + kStages, 0, ok_a);  // block ids of a later iteration, in flight meanwhile
    slot_b = locate(it + kStages, 1, ok_b);
    cp_async_wait<kStages - 1>();
    const int st = it % kStages;
    const int t = lo + it * 2 * kRows + rg;
    attend_pair<kLanes, G, T, C>(t < hi, t + kRows < hi, *at(st, 0, 0), *at(st, 0, 1), *at(st, 1, 0), *at(st, 1, 1), q,
                              acc, m, l);
  }
  cp_async_wait<0>();
  __syncthreads();

  // Merge the row groups.
  auto* s_m = reinterpret_cast<float*>(smem);                 // [kRows][G]
  auto* s_l = s_m + kRows * G;                                // [kRows][G]
  auto* s_acc = s_l + kRows * G;                              // [kRows][G][D]
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      s_m[rg * G + g] = m[g];
      s_l[rg * G + g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) s_acc[(rg * G + g) * D + lane * kVec + i] = acc[g][i];
  }
  __syncthreads();
  store_merged<T, D>(a, s_m, s_l, s_acc, kRows, G, heads_here, head0, b, split);
}

template <class T>
__global__ void write_kv_kernel(const T* k, const T* v, int64_t k_stride, int64_t v_stride, T* kc, T* vc,
                                const int32_t* slots, int64_t width) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    kc[slot * width + i] = k[t * k_stride + i];
    vc[slot * width + i] = v[t * v_stride + i];
  }
}

// One warp per (token, K|V, KV head) row: the row's largest magnitude by a warp reduction, then
// the codes (the arithmetic of model/cuda/fp8.cu's row quantizer, so the CPU's quantize_rows gives
// the same bytes).
template <class T>
__global__ void write_kv_fp8_kernel(const T* k, const T* v, int64_t k_stride, int64_t v_stride, uint8_t* kc,
                                    uint8_t* vc, float* k_scale, float* v_scale, const int32_t* slots,
                                    int64_t kv_heads, int head_dim) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t i = blockIdx.y * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= 2 * kv_heads) return;
  const bool is_v = i >= kv_heads;
  const int64_t h = is_v ? i - kv_heads : i;
  const T* x = (is_v ? v + t * v_stride : k + t * k_stride) + h * head_dim;
  float amax = 0.f;
  for (int j = lane; j < head_dim; j += 32) amax = fmaxf(amax, fabsf(model::cuda::to_f(x[j])));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = amax > 0.f ? amax / 448.f : 1.f;  // IEEE division, as ATen's
  const int64_t at = slot * kv_heads + h;
  uint8_t* q = (is_v ? vc : kc) + at * head_dim;
  for (int j = lane; j < head_dim; j += 32)
    q[j] = __nv_cvt_float_to_fp8(model::cuda::to_f(x[j]) / s, __NV_SATFINITE, __NV_E4M3);
  if (lane == 0) (is_v ? v_scale : k_scale)[at] = s;
}

// Query heads per thread block: groups of more than 4 (Qwen2's 7) run as blocks of 4 sharing a
// KV head, whose K/V the second block mostly finds in L2. Measured on an H200 against blocks of
// 8 (K/V read once, but 2 blocks per SM at 225+ registers): 0.5B batch 256 decode steps 3.63 vs
// 4.17 ms, 7B 11.47 vs 11.35 ms (docs/benchmarks.md).
int group_tile(int64_t group) { return group <= 1 ? 1 : group <= 2 ? 2 : kMaxGroup; }

template <class T, class C, int D, int G>
void launch_decode(const PagedDecode& a, cudaStream_t stream) {
  const int64_t chunks = (a.heads / a.kv_heads + G - 1) / G;
  const dim3 grid(static_cast<unsigned>(a.kv_heads * chunks), static_cast<unsigned>(a.batch),
                  static_cast<unsigned>(a.splits));
  paged_decode_kernel<T, C, D, G><<<grid, kThreads, 0, stream>>>(a);
  check_launch("paged decode attention");
  launch_combine<T>(a, stream);
}

template <class T, class C, int D>
void dispatch_group(const PagedDecode& a, cudaStream_t stream) {
  switch (group_tile(a.heads / a.kv_heads)) {
    case 1: return launch_decode<T, C, D, 1>(a, stream);
    case 2: return launch_decode<T, C, D, 2>(a, stream);
    default: return launch_decode<T, C, D, kMaxGroup>(a, stream);
  }
}

template <class T, class C = T>
void dispatch_dim(const PagedDecode& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 16: return dispatch_group<T, C, 16>(a, stream);
    case 32: return dispatch_group<T, C, 32>(a, stream);
    case 64: return dispatch_group<T, C, 64>(a, stream);
    case 128: return dispatch_group<T, C, 128>(a, stream);
    case 256: return dispatch_group<T, C, 256>(a, stream);
    default: throw std::invalid_argument("paged decode attention: head_dim " + std::to_string(a.head_dim));
  }
}

int multiprocessors(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 132;
    cached[device] = n;
  }
  return cached[device];
}

}  // namespace

bool paged_decode_supports(int64_t head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

void write_kv(DType dtype, const void* k, const void* v, int64_t k_token_stride, int64_t v_token_stride,
              void* k_cache, void* v_cache, const int32_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim,
              void* stream) {
  if (tokens == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t width = kv_heads * head_dim;
  const auto threads = static_cast<unsigned>(std::min<int64_t>(256, width));
  model::cuda::with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    write_kv_kernel<<<static_cast<unsigned>(tokens), threads, 0, s>>>(
        static_cast<const T*>(k), static_cast<const T*>(v), k_token_stride, v_token_stride, static_cast<T*>(k_cache),
        static_cast<T*>(v_cache), slots, width);
  });
  check_launch("KV cache write");
}

void write_kv_fp8(DType dtype, const void* k, const void* v, int64_t k_token_stride, int64_t v_token_stride,
                  void* k_cache, void* v_cache, float* k_scale, float* v_scale, const int32_t* slots, int64_t tokens,
                  int64_t kv_heads, int64_t head_dim, void* stream) {
  if (tokens == 0) return;
  constexpr int kWarpsPerBlock = 4;
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>((2 * kv_heads + kWarpsPerBlock - 1) / kWarpsPerBlock));
  model::cuda::with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    write_kv_fp8_kernel<<<grid, 32 * kWarpsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(k), static_cast<const T*>(v), k_token_stride, v_token_stride,
        static_cast<uint8_t*>(k_cache), static_cast<uint8_t*>(v_cache), k_scale, v_scale, slots, kv_heads,
        static_cast<int>(head_dim));
  });
  check_launch("FP8 KV cache write");
}

int64_t paged_decode_splits(DType dtype, int64_t head_dim, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t max_len, int device) {
  const int64_t group = heads / kv_heads;
  // Work items: (sequence, KV head) for the tensor-core kernel (4 blocks of 4 warps per SM at
  // head size 64, 3 at 128), (sequence, KV head, chunk of query heads) for the other (4). Splits
  // to fill the GPU once, rounded: a combine pass costs more than a few idle SMs.
  const bool mma = paged_decode_mma_serves(dtype, head_dim, group);  // an FP8 cache's too
  const int64_t tile = mma ? group : group_tile(group);
  const int64_t items = std::max<int64_t>(1, batch * kv_heads * ((group + tile - 1) / tile));
  const int64_t per_sm = mma && head_dim > 64 ? 3 : 4;
  const int64_t target = per_sm * static_cast<int64_t>(multiprocessors(device));
  int64_t splits = std::clamp<int64_t>((target + items / 2) / items, 1, kMaxSplits);
  if (max_len > 0) splits = std::min(splits, std::max<int64_t>(1, max_len / 64));
  return splits;
}

int64_t paged_decode_pack_keys(DType dtype, int64_t head_dim, int64_t batch, int64_t heads, int64_t kv_heads,
                               int64_t splits, int64_t wanted, int device) {
  if (wanted <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || !paged_decode_mma_serves(dtype, head_dim, heads / kv_heads))
    return 0;
  const int64_t per_sm = head_dim > 64 ? 3 : 4;  // the tensor-core kernel's blocks per SM (kBlocksPerSm)
  return batch * kv_heads * splits > 2 * per_sm * static_cast<int64_t>(multiprocessors(device)) ? wanted : 0;
}

int64_t paged_decode_workspace_floats(int64_t batch, int64_t heads, int64_t head_dim, int64_t splits) {
  return splits > 1 ? batch * heads * splits * (head_dim + 1) : 0;
}

bool paged_decode_rotates(DType dtype, int64_t head_dim, int64_t heads, int64_t kv_heads) {
  return kv_heads > 0 && heads % kv_heads == 0 && detail::paged_decode_mma_serves(dtype, head_dim, heads / kv_heads);
}

bool paged_decode_prefill_serves(DType dtype, int64_t head_dim, int64_t heads, int64_t kv_heads) {
  return paged_decode_rotates(dtype, head_dim, heads, kv_heads);  // where decode steps run on tensor cores
}

void paged_decode_prefill(const PrefillRows& a, void* stream) {
  if (a.count == 0) return;
  if (!paged_decode_prefill_serves(a.dtype, a.head_dim, a.heads, a.kv_heads))
    throw std::invalid_argument("bitwise prefill attention: a shape the tensor-core decode kernel does not serve");
  detail::paged_decode_prefill_mma(a, static_cast<cudaStream_t>(stream));
}

void paged_decode_attention(const PagedDecode& a, void* stream) {
  if (a.batch == 0) return;
  if (a.heads % a.kv_heads || a.splits < 1 || a.splits > kMaxSplits || (a.splits > 1 && !a.workspace))
    throw std::invalid_argument("paged decode attention: bad heads/kv_heads/splits/workspace");
  const auto s = static_cast<cudaStream_t>(stream);
  if (a.cache_fp8) {
    if (a.k_new || a.rope_cos || a.key_base || !a.k_scale || !a.v_scale || a.dtype == DType::kFloat)
      throw std::invalid_argument("paged decode attention: an FP8 cache takes bf16/fp16 queries, its scales, and no "
                                  "new rows, RoPE tables or contiguous keys (write_kv_fp8 stores the step's rows)");
    if (paged_decode_mma(a, s)) return;  // the tensor-core kernel's shapes
    model::cuda::with_dtype(a.dtype, [&](auto t) {
      using T = typename decltype(t)::type;
      if constexpr (!std::is_same_v<T, float>) dispatch_dim<T, E4m3>(a, s);
    });
    return;
  }
  if (paged_decode_mma(a, s)) return;
  if (a.rope_cos) throw std::invalid_argument("paged decode attention: RoPE tables for a shape that only the CUDA-core "
                                              "kernel serves (check paged_decode_rotates)");
  if (a.k_new)
    write_kv(a.dtype, a.k_new, a.v_new, a.k_new_stride, a.v_new_stride, a.k_cache,
             a.v_cache, a.slots, a.batch, a.kv_heads, a.head_dim, stream);
  model::cuda::with_dtype(a.dtype, [&](auto t) { dispatch_dim<typename decltype(t)::type>(a, s); });
}

}  // namespace tiller::model::cuda
