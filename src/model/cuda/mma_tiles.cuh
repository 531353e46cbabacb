// The tensor-core tiles of the decode-attention kernel (paged_decode_mma.cu) and its bitwise
// prefill form (paged_prefill_mma.cu), shared so that the two round alike: the m16n8k16 MMA and
// ldmatrix wrappers, the XOR-swizzled tile layout, the per-warp pipeline's sizes, one 16-key tile
// of the online softmax (their opt-in to more than 48 KiB of shared memory: convert.cuh's
// reserve_shared_memory). CUDA translation units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "model/cuda/convert.cuh"

namespace tiller::model::cuda::detail {

constexpr int kWarps = 4;
constexpr int kKeys = 16;     // keys per warp tile: N of QK^T (two n8 tiles), K of PV
constexpr int kTileRows = 16; // query heads per MMA tile
constexpr unsigned kFull = 0xffffffffu;

template <class T>
__device__ __forceinline__ void unpack2(uint32_t v, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 p = *reinterpret_cast<const __nv_bfloat162*>(&v);
    lo = __low2float(p);
    hi = __high2float(p);
  } else {
    const __half2 p = *reinterpret_cast<const __half2*>(&v);
    lo = __low2float(p);
    hi = __high2float(p);
  }
}

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// c += a b for one m16n8k16 tile: a row-major 16x16 (4 registers), b column-major 16x8 (2).
template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 matrices of 16-bit elements from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8. trans: each lane receives a column pair instead of a row pair.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void st_shared16(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Byte offset of 16-byte chunk `col` of key `key` in a [kKeys][D] tile, XOR-swizzled so that the
// 8 rows an ldmatrix reads at one column lie in 8 different bank groups.
template <int D>
__device__ __forceinline__ uint32_t tile_offset(int key, int col) {
  return static_cast<uint32_t>(key * D * 2 + ((col ^ (key & 7)) << 4));
}

// Per-warp cp.async pipeline depth, and thread blocks per SM: at head size 128, 2 stages (64 KiB
// per block) let 3 blocks share an SM, which hides the start-up latency of short contexts better
// than a third stage does.
template <int D>
constexpr int kStagesOf = D <= 64 ? 3 : 2;
template <int D>
constexpr int kBlocksPerSm = D <= 64 ? 4 : 3;
template <int D>
constexpr int kSmemBytes = kWarps * kStagesOf<D> * 2 * kKeys * D * 2;
// Dynamic shared memory of a block: the pipeline (which the merge reuses), then with RoPE each
// warp's copy of this step's key, rotated (2-byte elements).
template <int D>
constexpr int kSmemTotal = kSmemBytes<D> + kWarps * D * 2;
// With an FP8 cache, per warp: the stages of codes (K then V, kKeys x D bytes each) and scales (K
// then V, kKeys floats each), then one tile of K and V in T that the MMAs read.
template <int D>
constexpr int kFp8StageBytes = 2 * kKeys * D + 2 * kKeys * 4;
template <int D>
constexpr int kFp8WarpBytes = kStagesOf<D> * kFp8StageBytes<D> + 2 * kKeys * D * 2;
template <int D>
constexpr int kFp8SmemTotal = kWarps * kFp8WarpBytes<D>;

// One 16-key tile of the online softmax, shared by the decode kernel and its prefill form so that
// both round alike. A lane holds rows r and r + 8 (r = lane / 4) and columns c2, c2 + 1 of each n8
// tile.
// S = Q K^T for the tile at k_tile: two n8 tiles of keys x D/16 k-steps, K via ldmatrix.
template <class T, int D>
__device__ __forceinline__ void tile_scores(const uint32_t (&qf)[D / 16][4], uint32_t k_tile, int lane,
                                            float (&s)[2][4]) {
#pragma unroll
  for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    // Matrices: keys 0-7 at chunks 2kk, 2kk+1; keys 8-15 at the same (b0, b1 of each n8 tile).
    const int mat = lane / 8, key = (mat >> 1) * 8 + lane % 8, col = 2 * kk + (mat & 1);
    uint32_t kb[4];
    ldsm_x4(k_tile + tile_offset<D>(key, col), kb);
    mma16816<T>(s[0], qf[kk], kb[0], kb[1]);
    mma16816<T>(s[1], qf[kk], kb[2], kb[3]);
  }
}

// The scores in log2 units, -inf at keys t >= the row's end (hi_lo for row r, hi_hi for r + 8);
// t0 is the tile's first key.
__device__ __forceinline__ void scale_and_mask(float (&s)[2][4], int t0, int c2, int hi_lo, int hi_hi, float qscale) {
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = t0 + n * 8 + c2 + e;
      s[n][e] = t < hi_lo ? s[n][e] * qscale : -INFINITY;
      s[n][2 + e] = t < hi_hi ? s[n][2 + e] * qscale : -INFINITY;
    }
}

// The online softmax's step over the tile's scores and O += P V with V at v_tile: the running
// maxima m (log2 units), this lane's share of the sums l, and O rescaled. A row whose maximum is
// still -inf (no key yet: the decode kernel never has one) keeps an empty state.
template <class T, int D>
__device__ __forceinline__ void online_step(const float (&s)[2][4], float& m_lo, float& m_hi, float& l_lo, float& l_hi,
                                            float (&o)[D / 8][4], uint32_t v_tile, int lane) {
  float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      mx_lo = fmaxf(mx_lo, s[n][e]);
      mx_hi = fmaxf(mx_hi, s[n][2 + e]);
    }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {  // the 4 lanes of a row
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(kFull, mx_lo, off));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(kFull, mx_hi, off));
  }
  const float e_lo = mx_lo == -INFINITY ? 0.f : mx_lo, e_hi = mx_hi == -INFINITY ? 0.f : mx_hi;
  const float alpha_lo = exp2f(m_lo - e_lo), alpha_hi = exp2f(m_hi - e_hi);
  m_lo = mx_lo;
  m_hi = mx_hi;
  float p[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    p[n][0] = exp2f(s[n][0] - e_lo);
    p[n][1] = exp2f(s[n][1] - e_lo);
    p[n][2] = exp2f(s[n][2] - e_hi);
    p[n][3] = exp2f(s[n][3] - e_hi);
  }
  l_lo = fmaf(l_lo, alpha_lo, (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
  l_hi = fmaf(l_hi, alpha_hi, (p[0][2] + p[0][3]) + (p[1][2] + p[1][3]));
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    o[n][0] *= alpha_lo;
    o[n][1] *= alpha_lo;
    o[n][2] *= alpha_hi;
    o[n][3] *= alpha_hi;
  }
  // The S accumulators of the two key tiles are exactly P's A fragment for k = 16 keys.
  const uint32_t pa[4] = {pack2<T>(p[0][0], p[0][1]), pack2<T>(p[0][2], p[0][3]), pack2<T>(p[1][0], p[1][1]),
                          pack2<T>(p[1][2], p[1][3])};
#pragma unroll
  for (int n = 0; n < D / 8; n += 2) {
    // Matrices (transposed): keys 0-7 and 8-15 at chunk n, then at chunk n + 1.
    const int mat = lane / 8, key = (mat & 1) * 8 + lane % 8, col = n + (mat >> 1);
    uint32_t vb[4];
    ldsm_x4_trans(v_tile + tile_offset<D>(key, col), vb);
    mma16816<T>(o[n], pa, vb[0], vb[1]);
    mma16816<T>(o[n + 1], pa, vb[2], vb[3]);
  }
}

// The block's partial softmax states in its shared memory, as merge_parts (decode_common.cuh)
// reads them: m and l [kWarps][kTileRows], then the unnormalised outputs [kWarps][kTileRows][D].
struct PartStates {
  float *m, *l, *acc;
};
__device__ __forceinline__ PartStates part_states(unsigned char* smem) {
  auto* m = reinterpret_cast<float*>(smem);
  return {m, m + kWarps * kTileRows, m + 2 * kWarps * kTileRows};
}

// Warp `warp`'s state (its rows r and r + 8, l still this lane's share) into part `warp` of the
// block's states: each row's l summed over its 4 lanes, then stored with m and o. The caller
// makes the block's pipelines idle before (the states reuse their memory) and syncs after.
template <int D>
__device__ __forceinline__ void stash_part(const PartStates& st, int warp, int lane, const float (&o)[D / 8][4],
                                           float m_lo, float m_hi, float l_lo, float l_hi) {
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_lo += __shfl_xor_sync(kFull, l_lo, off);
    l_hi += __shfl_xor_sync(kFull, l_hi, off);
  }
  const int r = lane / 4, c2 = 2 * (lane % 4);
  const int row_lo = warp * kTileRows + r, row_hi = row_lo + 8;
  if (lane % 4 == 0) {
    st.m[row_lo] = m_lo;
    st.m[row_hi] = m_hi;
    st.l[row_lo] = l_lo;
    st.l[row_hi] = l_hi;
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    st.acc[row_lo * D + n * 8 + c2] = o[n][0];
    st.acc[row_lo * D + n * 8 + c2 + 1] = o[n][1];
    st.acc[row_hi * D + n * 8 + c2] = o[n][2];
    st.acc[row_hi * D + n * 8 + c2 + 1] = o[n][3];
  }
}

}  // namespace tiller::model::cuda::detail
