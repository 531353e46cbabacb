// algo.logprob_match = bitwise: the prefill form of the tensor-core decode kernel
// (paged_decode_mma.cu; paged_attention.h's PrefillRows). One warp serves one PrefillRows block of
// up to 16 query tokens of one query head (the MMA tile's rows); a thread block holds
// kPrefillWarps such warps, each with its own cp.async pipeline. A row's arithmetic is the decode
// kernel's for that token (the tile functions of mma_tiles.cuh):
//  - first a pass over the K tiles finds each row's maximum scaled score: the maximum over the
//    decode kernel's 4 partial states, which their merge takes first (a maximum is exact);
//  - then for each part w (the decode kernel's warp w: key tiles w, w + 4, ...) the same online
//    softmax over the same tiles, each row masked at its own length (tiles past a row's keys are
//    masked whole, which leaves its state as it was; an empty state stays empty), folded into
//    the merged sums right away in part order with merge_parts' formulas.
#include <algorithm>
#include <cstdint>

#include "model/cuda/decode_common.cuh"
#include "model/cuda/mma_tiles.cuh"

namespace tiller::model::cuda::detail {
namespace {

constexpr int kPrefillWarps = 4;
template <int D>
constexpr int kPrefillSmem = kPrefillWarps * kStagesOf<D> * 2 * kKeys * D * 2;

template <class T, int D>
__global__ void __launch_bounds__(kPrefillWarps * 32) paged_prefill_mma_kernel(PrefillRows a) {
  constexpr int kChunks = D / 8;
  constexpr int kTileBytes = kKeys * D * 2;
  constexpr int kStages = detail::kStagesOf<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kPrefillWarps + warp;  // (row block, head)
  if (item >= a.count * a.heads) return;  // warp-uniform; no block barrier below
  const int head = static_cast<int>(item % a.heads);
  const int32_t* info = a.blocks + 4 * (item / a.heads);
  const int q_row0 = info[0], rows = info[1], key0 = info[2], pos0 = info[3];
  const int kv_head = head / static_cast<int>(a.heads / a.kv_heads);
  const int r = lane / 4, c2 = 2 * (lane % 4);
  // Row i's keys: 0 ..= pos0 + i (none past the block's rows).
  const int hi_lo = r < rows ? pos0 + r + 1 : 0, hi_hi = r + 8 < rows ? pos0 + r + 9 : 0;
  const int hi = pos0 + rows;  // the block's last row's keys
  const int64_t row_elems = a.kv_heads * D;
  const T* kc = static_cast<const T*>(a.k) + static_cast<int64_t>(key0) * row_elems + kv_head * D;
  const T* vc = static_cast<const T*>(a.v) + static_cast<int64_t>(key0) * row_elems + kv_head * D;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * kStages * 2 * kTileBytes;
  const int tiles = (hi + kKeys - 1) / kKeys;
  const float qscale = a.scale * kLog2e;

  uint32_t qf[D / 16][4];
  {
    const T* qp = static_cast<const T*>(a.q) + static_cast<int64_t>(q_row0) * a.q_token_stride +
                  static_cast<int64_t>(head) * D;
    auto ld = [&](int row, int col) {
      return row < rows ? *reinterpret_cast<const uint32_t*>(qp + row * a.q_token_stride + col) : 0u;
    };
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qf[kk][0] = ld(r, kk * 16 + c2);
      qf[kk][1] = ld(r + 8, kk * 16 + c2);
      qf[kk][2] = ld(r, kk * 16 + 8 + c2);
      qf[kk][3] = ld(r + 8, kk * 16 + 8 + c2);
    }
  }
  // The tiles at `starts(i)` for i < count into the pipeline: K always, V with `with_v`.
  auto issue = [&](int i, int count, int start, bool with_v) {
    if (i < count) {
      const uint32_t k_tile = base + (i % kStages) * 2 * kTileBytes, v_tile = k_tile + kTileBytes;
#pragma unroll
      for (int j = 0; j < kKeys * kChunks / 32; ++j) {
        const int c = lane + 32 * j, key = c / kChunks, col = c % kChunks;
        const int t = start + key;
        const bool ok = t < hi;
        const int64_t at = ok ? static_cast<int64_t>(t) * row_elems + col * 8 : 0;
        cp_async16(k_tile + tile_offset<D>(key, col), kc + at, ok);
        if (with_v) cp_async16(v_tile + tile_offset<D>(key, col), vc + at, ok);
      }
    }
    cp_async_commit();
  };
  auto scores = [&](int i, int t0, float (&s)[2][4]) {
    tile_scores<T, D>(qf, base + (i % kStages) * 2 * kTileBytes, lane, s);
    scale_and_mask(s, t0, c2, hi_lo, hi_hi, qscale);
  };

  // Pass 1: each row's maximum over all its keys.
  float g_lo = -INFINITY, g_hi = -INFINITY;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i, tiles, i * kKeys, false);
  for (int i = 0; i < tiles; ++i) {
    issue(i + kStages - 1, tiles, (i + kStages - 1) * kKeys, false);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    float s[2][4];
    scores(i, i * kKeys, s);
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        g_lo = fmaxf(g_lo, s[n][e]);
        g_hi = fmaxf(g_hi, s[n][2 + e]);
      }
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncwarp();
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    g_lo = fmaxf(g_lo, __shfl_xor_sync(kFull, g_lo, off));
    g_hi = fmaxf(g_hi, __shfl_xor_sync(kFull, g_hi, off));
  }

  // Pass 2: the parts, each folded into the merged sums as merge_parts does.
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float sum_lo = 0.f, sum_hi = 0.f;
  for (int part = 0; part < kWarps; ++part) {
    const int mine = tiles > part ? (tiles - part + kWarps - 1) / kWarps : 0;
    auto tile_start = [&](int i) { return (part + i * kWarps) * kKeys; };
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(i, mine, tile_start(i), true);
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
    for (int i = 0; i < mine; ++i) {
      issue(i + kStages - 1, mine, tile_start(i + kStages - 1), true);
      cp_async_wait<kStages - 1>();
      __syncwarp();
      float s[2][4];
      scores(i, tile_start(i), s);
      online_step<T, D>(s, m_lo, m_hi, l_lo, l_hi, o, base + (i % kStages) * 2 * kTileBytes + kTileBytes, lane);
      __syncwarp();
    }
    cp_async_wait<0>();
    __syncwarp();
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      l_lo += __shfl_xor_sync(kFull, l_lo, off);
      l_hi += __shfl_xor_sync(kFull, l_hi, off);
    }
    // merge_parts: parts with no key are skipped; the weights against the rows' maxima. Row r
    // holds fragment elements 0 and 1, row r + 8 elements 2 and 3.
    auto fold = [&](float m, float g, float l, float& sum, int e0) {
      if (m == -INFINITY) return;
      const float w = exp2f(m - g);
      sum = fmaf(l, w, sum);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][e0] = fmaf(o[n][e0], w, acc[n][e0]);
        acc[n][e0 + 1] = fmaf(o[n][e0 + 1], w, acc[n][e0 + 1]);
      }
    };
    fold(m_lo, g_lo, l_lo, sum_lo, 0);
    fold(m_hi, g_hi, l_hi, sum_hi, 2);
  }
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(q_row0) * a.heads + head) * D;
  const int64_t row_stride = a.heads * D;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int d = n * 8 + c2;
    if (r < rows) {
      store(out + r * row_stride + d, sum_lo > 0.f ? acc[n][0] / sum_lo : 0.f);
      store(out + r * row_stride + d + 1, sum_lo > 0.f ? acc[n][1] / sum_lo : 0.f);
    }
    if (r + 8 < rows) {
      store(out + (r + 8) * row_stride + d, sum_hi > 0.f ? acc[n][2] / sum_hi : 0.f);
      store(out + (r + 8) * row_stride + d + 1, sum_hi > 0.f ? acc[n][3] / sum_hi : 0.f);
    }
  }
}

template <class T, int D>
void launch_prefill(const PrefillRows& a, cudaStream_t stream) {
  constexpr int kSmem = kPrefillSmem<D>;
  if constexpr (kSmem > 48 * 1024) {
    static bool done[64] = {};
    reserve_shared_memory(paged_prefill_mma_kernel<T, D>, kSmem, done, "bitwise prefill attention");
  }
  // Blocks of kPrefillWarps (row block, head) items; at most 2^31 - 1 items a launch.
  const int64_t per_launch = std::max<int64_t>(1, int64_t{0x7fffffff} / a.heads);
  for (int64_t b0 = 0; b0 < a.count; b0 += per_launch) {
    PrefillRows part = a;
    part.blocks = a.blocks + 4 * b0;
    part.count = std::min<int64_t>(per_launch, a.count - b0);
    const int64_t items = part.count * a.heads;
    const dim3 grid(static_cast<unsigned>((items + kPrefillWarps - 1) / kPrefillWarps));
    paged_prefill_mma_kernel<T, D><<<grid, kPrefillWarps * 32, kSmem, stream>>>(part);
    check_launch("bitwise prefill attention (tensor cores)");
  }
}
}  // namespace

void paged_decode_prefill_mma(const PrefillRows& a, cudaStream_t stream) {
  auto run = [&](auto t) {
    using T = decltype(t);
    if (a.head_dim == 64) return launch_prefill<T, 64>(a, stream);
    return launch_prefill<T, 128>(a, stream);
  };
  if (a.dtype == DType::kBFloat16)
    run(__nv_bfloat16{});
  else
    run(__half{});
}


}  // namespace tiller::model::cuda::detail
