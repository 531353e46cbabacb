// algo.logprob_match = bitwise: the prefill form of the tensor-core decode kernel
// (paged_decode_mma.cu; paged_attention.h's PrefillRows). A thread block of kWarps warps serves
// one PrefillRows block of up to 16 query tokens of one query head (the MMA tile's rows), laid out
// as the decode kernel's block: warp w runs the decode kernel's part w (key tiles w, w + 4, ...)
// with the same online softmax over the same tiles, each row masked at its own length (tiles past
// a row's keys are masked whole, which leaves its state as it was; an empty state stays empty),
// and the parts merge through shared memory with the decode kernel's own merge (merge_parts). A
// row's arithmetic is thus the decode kernel's for that token.
// The first form ran the 4 parts one after another on one warp, after a pass over K for the rows'
// maxima (each K tile read twice, 8x the steps in a row per item); this one reads each tile once.
// Blocks run the longest rows first (the list's last), so that the causal tail is short.
#include <algorithm>
#include <cstdint>

#include "model/cuda/decode_common.cuh"
#include "model/cuda/mma_tiles.cuh"

namespace tiller::model::cuda::detail {
namespace {

template <int D>
constexpr int kPrefillSmem = kSmemBytes<D>;  // the decode kernel's pipelines; the merge reuses them

template <class T, int D>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm<D>) paged_prefill_mma_kernel(PrefillRows a) {
  constexpr int kChunks = D / 8;
  constexpr int kTileBytes = kKeys * D * 2;
  constexpr int kStages = detail::kStagesOf<D>;
  static_assert(kWarps * kTileRows * (D + 2) * 4 <= kPrefillSmem<D>, "the merge reuses the pipeline's memory");
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // (row block, head), the list's last first.
  const int64_t item = a.count * a.heads - 1 - static_cast<int64_t>(blockIdx.x);
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
  const int mine = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;  // this warp's tiles
  auto tile_start = [&](int i) { return (warp + i * kWarps) * kKeys; };
  const float qscale = a.scale * kLog2e;

  // This warp's tile i into the pipeline (K and V).
  auto issue = [&](int i) {
    if (i < mine) {  // warp-uniform
      const uint32_t k_tile = base + (i % kStages) * 2 * kTileBytes, v_tile = k_tile + kTileBytes;
#pragma unroll
      for (int j = 0; j < kKeys * kChunks / 32; ++j) {
        const int c = lane + 32 * j, key = c / kChunks, col = c % kChunks;
        const int t = tile_start(i) + key;
        const bool ok = t < hi;
        const int64_t at = ok ? static_cast<int64_t>(t) * row_elems + col * 8 : 0;
        cp_async16(k_tile + tile_offset<D>(key, col), kc + at, ok);
        cp_async16(v_tile + tile_offset<D>(key, col), vc + at, ok);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

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

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
  for (int i = 0; i < mine; ++i) {
    issue(i + kStages - 1);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const uint32_t k_tile = base + (i % kStages) * 2 * kTileBytes;
    float s[2][4];
    tile_scores<T, D>(qf, k_tile, lane, s);
    scale_and_mask(s, tile_start(i), c2, hi_lo, hi_hi, qscale);
    online_step<T, D>(s, m_lo, m_hi, l_lo, l_hi, o, k_tile + kTileBytes, lane);
    __syncwarp();  // every lane has read this stage before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the pipelines before the merge reuses them

  // The decode kernel's merge: the parts through shared memory, then in order.
  const PartStates st = part_states(smem);
  stash_part<D>(st, warp, lane, o, m_lo, m_hi, l_lo, l_hi);
  __syncthreads();
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(q_row0) * a.heads + head) * D;
  const int64_t row_stride = a.heads * D;
  for (int idx = threadIdx.x; idx < rows * D; idx += kWarps * 32) {
    const int g = idx / D, d = idx % D;
    float mx, sum, acc;
    merge_parts<D>(st.m, st.l, st.acc, kWarps, kTileRows, g, d, mx, sum, acc);
    store(out + g * row_stride + d, sum > 0.f ? acc / sum : 0.f);
  }
}

template <class T, int D>
void launch_prefill(const PrefillRows& a, cudaStream_t stream) {
  constexpr int kSmem = kPrefillSmem<D>;
  if constexpr (kSmem > 48 * 1024) {
    static bool done[64] = {};
    reserve_shared_memory(paged_prefill_mma_kernel<T, D>, kSmem, done, "bitwise prefill attention");
  }
  // One block a (row block, head); at most 2^31 - 1 blocks a launch.
  const int64_t per_launch = std::max<int64_t>(1, int64_t{0x7fffffff} / a.heads);
  for (int64_t b0 = 0; b0 < a.count; b0 += per_launch) {
    PrefillRows part = a;
    part.blocks = a.blocks + 4 * b0;
    part.count = std::min<int64_t>(per_launch, a.count - b0);
    const dim3 grid(static_cast<unsigned>(part.count * a.heads));
    paged_prefill_mma_kernel<T, D><<<grid, kWarps * 32, kSmem, stream>>>(part);
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
