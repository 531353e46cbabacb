// Decode attention on tensor cores (bf16/fp16, head size 64 or 128, 2 to 16 query heads per KV
// head). See paged_attention.h for the contract.
//
// A thread block of 4 warps serves one (sequence, KV head, split): an item. The KV head's query
// heads are the 16 rows of an m16n8k16 MMA tile (rows past the group are zero), so every K/V row
// is read once for all of them. The warps take the split's 16-key tiles in turn, each with its own
// cp.async pipeline into XOR-swizzled shared memory (no barriers in the loop, ldmatrix without
// bank conflicts) and its own online softmax (log2 units, fp32):
//   S = Q K^T   two n8 tiles of keys x D/16 k-steps, K via ldmatrix;
//   P = exp2(S - m), rescale O, P rounded to the input type as the A operand of
//   O += P V    D/8 n8 tiles of the head dimension, V via ldmatrix.trans.
// The warps' states merge through shared memory at the end (decode_common.cuh).
// Short items (PagedDecode::pack_keys; the engine asks for them where the four-warp grid would
// take more than two waves, paged_decode_pack_keys) run on one warp each instead, four of them in
// one block: at a 150-token context each of 4 warps had 2-3 tiles and paid the fixed costs (the
// block-list and Q loads, RoPE of Q, the merge) for them; 7B at batch 256 on H200: 51 -> 40 us
// a layer.
// With RoPE tables (PagedDecode::rope_cos), q and this step's key arrive before RoPE: the kernel
// rotates the Q fragments in registers and the step's key once per warp into shared memory, from
// where the tiles and the cache store take it: the rotation costs no launch and no block barrier.
// An FP8 cache (PagedDecode::cache_fp8): the pipeline carries each tile's e4m3 codes and row
// scales (half the bytes); before its MMAs a warp turns them into the same swizzled bf16/fp16
// tile, code x scale rounded to T (model::fp8::dequantize_rows), so the MMAs are the same.
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "model/cuda/convert.cuh"
#include "model/cuda/decode_common.cuh"
#include "model/cuda/mma_tiles.cuh"

namespace tiller::model::cuda::detail {
namespace {

// One warp's part of the item (sequence b, KV head, split) that W warps serve: the split's key
// tiles w, w + W, w + 2W, ... (W = 1: all of them), through the warp's own pipeline at `base` in
// shared memory (with RoPE, its copy of the step's rotated key at `k_rot`). Leaves the warp's
// online-softmax state: o, and m and l of its rows r and r + 8 (l summed over this lane's columns
// only), every copy drained.
template <class T, int D, bool kFp8>
__device__ __forceinline__ void attend(const PagedDecode& a, int kv_head, int b, int split, int w, int W,
                                       uint32_t base, T* k_rot, float (&o)[D / 8][4], float& m_lo, float& m_hi,
                                       float& l_lo, float& l_hi) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per K/V row
  constexpr int kTileBytes = kKeys * D * 2;
  constexpr int kStages = detail::kStagesOf<D>;
  const int lane = threadIdx.x % 32;
  const int group = static_cast<int>(a.heads / a.kv_heads);
  const int head0 = kv_head * group;
  const SplitRange range = split_range(a, b, split, kKeys);
  const int lo = range.lo, hi = range.hi;
  const int r = lane / 4, c2 = 2 * (lane % 4);  // this lane's fragment row and column pair
  const bool rope = a.rope_cos != nullptr;

  // This step's K/V rows: the sequence's last key is read from them (never from the cache row
  // being written), and the first split's block stores them into the cache at the end.
  const int last = a.k_new ? a.seq_lens[b] - 1 : -1;
  const T* k_row = a.k_new ? static_cast<const T*>(a.k_new) + b * a.k_new_stride + kv_head * D : nullptr;
  const T* k_new = last >= 0 ? k_row : nullptr;
  const T* v_new = last >= 0 ? static_cast<const T*>(a.v_new) + b * a.v_new_stride + kv_head * D : nullptr;
  const T* qp = static_cast<const T*>(a.q) + b * a.q_token_stride + static_cast<int64_t>(head0) * D;
  const uint32_t k_rot_addr = static_cast<uint32_t>(__cvta_generic_to_shared(k_rot));
  const int32_t* blocks = a.key_base ? nullptr : a.blocks + a.offsets[b];
  const int key0 = a.key_base ? a.key_base[b] : 0;
  const int64_t row_elems = a.kv_heads * D;
  const int bs = static_cast<int>(a.block_size);
  const T* kc = static_cast<const T*>(a.k_cache) + kv_head * D;
  const T* vc = static_cast<const T*>(a.v_cache) + kv_head * D;
  const int tiles = hi > lo ? (hi - lo + kKeys - 1) / kKeys : 0;
  const int mine = tiles > w ? (tiles - w + W - 1) / W : 0;  // this warp's tiles
  // FP8: stage i's codes and scales, and the T tile the MMAs read (K, then V).
  const uint32_t conv_tile = base + kStages * kFp8StageBytes<D>;
  auto fp8_stage = [&](int i) { return base + (i % kStages) * kFp8StageBytes<D>; };
  auto tile_start = [&](int i) { return lo + (w + i * W) * kKeys; };
  // Cache slot of key `lane` of this warp's tile i (lanes < kKeys); -1 past the end, -2 for the
  // step's own key (read from k_new/v_new).
  auto key_slot = [&](int i) -> int {
    if (i >= mine || lane >= kKeys) return -1;
    const int t = tile_start(i) + lane;
    return t >= hi ? -1 : t == last ? -2 : blocks ? blocks[t / bs] * bs + t % bs : key0 + t;
  };
  auto issue = [&](int i, int slot) {
    if constexpr (kFp8) {
      if (i < mine) {
        // Codes: kKeys rows of D bytes for K and V, 16 bytes a copy; scales: lane l < kKeys copies
        // K's of key l, lane kKeys + l V's.
        const uint32_t st = fp8_stage(i);
        const auto* kb = static_cast<const uint8_t*>(a.k_cache) + kv_head * D;
        const auto* vb = static_cast<const uint8_t*>(a.v_cache) + kv_head * D;
#pragma unroll
        for (int j = 0; j < kKeys * (D / 16) / 32; ++j) {
          const int c = lane + 32 * j, key = c / (D / 16), col = c % (D / 16);
          const int s = __shfl_sync(kFull, slot, key);
          const int64_t at = s < 0 ? 0 : static_cast<int64_t>(s) * row_elems + col * 16;
          cp_async16(st + key * D + col * 16, kb + at, s >= 0);
          cp_async16(st + kKeys * D + key * D + col * 16, vb + at, s >= 0);
        }
        const int key = lane % kKeys;
        const int s = __shfl_sync(kFull, slot, key);
        const int64_t at = s < 0 ? 0 : static_cast<int64_t>(s) * a.kv_heads + kv_head;
        cp_async4(st + 2 * kKeys * D + lane * 4, (lane < kKeys ? a.k_scale : a.v_scale) + at, s >= 0);
      }
      cp_async_commit();
      return;
    }
    if (i < mine) {  // warp-uniform
      const uint32_t k_tile = base + (i % kStages) * 2 * kTileBytes, v_tile = k_tile + kTileBytes;
#pragma unroll
      for (int j = 0; j < kKeys * kChunks / 32; ++j) {
        const int c = lane + 32 * j, key = c / kChunks, col = c % kChunks;
        const int s = __shfl_sync(kFull, slot, key);
        const int64_t at = s < 0 ? 0 : static_cast<int64_t>(s) * row_elems + col * 8;
        const T* k_src = s == -2 ? k_new + col * 8 : kc + at;
        const T* v_src = s == -2 ? v_new + col * 8 : vc + at;
        if (rope && s == -2) {  // the rotated key, from shared memory (ordered by the __syncwarp below)
          uint4 v;
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(k_rot_addr + col * 16));
          st_shared16(k_tile + tile_offset<D>(key, col), v);
        } else {
          cp_async16(k_tile + tile_offset<D>(key, col), k_src, s != -1);
        }
        cp_async16(v_tile + tile_offset<D>(key, col), v_src, s != -1);
      }
    }
    cp_async_commit();
  };

  // The slots of a tile are looked up one iteration before its copies are issued, so the block
  // id loads are in flight while the warp computes; those of the first tiles all at once.
  int first[kStages];
#pragma unroll
  for (int i = 0; i < kStages; ++i) first[i] = key_slot(i);

  // RoPE of the step's key, per warp (no block barrier): lanes < D/16 rotate 8 pairs each, while
  // the block-list lookups above are in flight; the tiles and the cache store take it from here.
  const T* rope_cos = rope ? static_cast<const T*>(a.rope_cos) + b * D : nullptr;
  const T* rope_sin = rope ? static_cast<const T*>(a.rope_sin) + b * D : nullptr;
  if (rope && k_row) {
    using V = model::cuda::Pack<T, 8>;
    if (lane < D / 16) {
      const int i = lane * 8;
      const V x1 = *reinterpret_cast<const V*>(k_row + i), x2 = *reinterpret_cast<const V*>(k_row + i + D / 2);
      const V c1 = *reinterpret_cast<const V*>(rope_cos + i), c2v = *reinterpret_cast<const V*>(rope_cos + i + D / 2);
      const V s1 = *reinterpret_cast<const V*>(rope_sin + i), s2 = *reinterpret_cast<const V*>(rope_sin + i + D / 2);
      V o1, o2;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float f1, f2;
        model::cuda::rope_pair(model::cuda::to_f(x1.v[e]), model::cuda::to_f(x2.v[e]), model::cuda::to_f(c1.v[e]),
                               model::cuda::to_f(s1.v[e]), model::cuda::to_f(c2v.v[e]), model::cuda::to_f(s2.v[e]),
                               f1, f2);
        o1.v[e] = model::cuda::from_f<T>(f1);
        o2.v[e] = model::cuda::from_f<T>(f2);
      }
      *reinterpret_cast<V*>(k_rot + i) = o1;
      *reinterpret_cast<V*>(k_rot + i + D / 2) = o2;
    }
    __syncwarp();
  }
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i, first[i]);

  // Q as the A operand of every k-step: rows are the group's query heads, zero beyond.
  uint32_t qf[D / 16][4];
  {
    auto ld = [&](int row, int col) {
      return row < group ? *reinterpret_cast<const uint32_t*>(qp + row * D + col) : 0u;
    };
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qf[kk][0] = ld(r, kk * 16 + c2);
      qf[kk][1] = ld(r + 8, kk * 16 + c2);
      qf[kk][2] = ld(r, kk * 16 + 8 + c2);
      qf[kk][3] = ld(r + 8, kk * 16 + 8 + c2);
    }
  }
  // RoPE of Q in registers: a column's partner (+- D/2) lies in the same lane's fragment D/32
  // k-steps away, so the pairs rotate where they are (rounded to T, as the RoPE kernel's output).
  if (rope) {
    constexpr int kHalf = D / 32;  // k-steps per half of the head
#pragma unroll
    for (int kk = 0; kk < kHalf; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = kk * 16 + (j >= 2 ? 8 : 0) + c2;  // of the first half; its partner + D/2
        float x1[2], x2[2], o1[2], o2[2], c1[2], s1[2], c2v[2], s2[2];
        unpack2<T>(qf[kk][j], x1[0], x1[1]);
        unpack2<T>(qf[kk + kHalf][j], x2[0], x2[1]);
        unpack2<T>(*reinterpret_cast<const uint32_t*>(rope_cos + col), c1[0], c1[1]);
        unpack2<T>(*reinterpret_cast<const uint32_t*>(rope_sin + col), s1[0], s1[1]);
        unpack2<T>(*reinterpret_cast<const uint32_t*>(rope_cos + col + D / 2), c2v[0], c2v[1]);
        unpack2<T>(*reinterpret_cast<const uint32_t*>(rope_sin + col + D / 2), s2[0], s2[1]);
#pragma unroll
        for (int e = 0; e < 2; ++e) model::cuda::rope_pair(x1[e], x2[e], c1[e], s1[e], c2v[e], s2[e], o1[e], o2[e]);
        qf[kk][j] = pack2<T>(o1[0], o1[1]);
        qf[kk + kHalf][j] = pack2<T>(o2[0], o2[1]);
      }
  }

#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  m_lo = m_hi = -INFINITY;  // rows r and r + 8
  l_lo = l_hi = 0.f;
  const float qscale = a.scale * kLog2e;

  int next = first[kStages - 1];
  for (int i = 0; i < mine; ++i) {
    issue(i + kStages - 1, next);
    next = key_slot(i + kStages);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    uint32_t k_tile = base + (i % kStages) * 2 * kTileBytes, v_tile = k_tile + kTileBytes;
    if constexpr (kFp8) {
      // Codes x scale, rounded to T, into the swizzled tile: 8 codes (one 16-byte chunk of T) a
      // step; a lane's chunks of a row are consecutive, so a half warp reads one 128-byte row.
      const uint32_t st = fp8_stage(i);
      k_tile = conv_tile;
      v_tile = conv_tile + kTileBytes;
#pragma unroll
      for (int j = 0; j < kKeys * kChunks / 32; ++j) {
        const int c = lane + 32 * j, key = c / kChunks, col = c % kChunks;
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
          uint32_t w0, w1;
          float scale;
          asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                       : "=r"(w0), "=r"(w1)
                       : "r"(st + kv * kKeys * D + key * D + col * 8));
          asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(scale) : "r"(st + 2 * kKeys * D + (kv * kKeys + key) * 4));
          // Two codes at a time (the low byte first), exactly into fp16, then x scale into T.
          auto two = [&](uint32_t word, int half) {
            const auto codes = static_cast<__nv_fp8x2_storage_t>((word >> (16 * half)) & 0xffffu);
            const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3)));
            return pack2<T>(f.x * scale, f.y * scale);
          };
          st_shared16((kv == 0 ? k_tile : v_tile) + tile_offset<D>(key, col),
                      make_uint4(two(w0, 0), two(w0, 1), two(w1, 0), two(w1, 1)));
        }
      }
      __syncwarp();
    }
    float s[2][4];
    tile_scores<T, D>(qf, k_tile, lane, s);
    scale_and_mask(s, tile_start(i), c2, hi, hi, qscale);
    online_step<T, D>(s, m_lo, m_hi, l_lo, l_hi, o, v_tile, lane);
    __syncwarp();  // every lane has read this stage before it is refilled
  }
  cp_async_wait<0>();
}

// This step's K/V rows into the cache (the rotated key from `k_rot` with RoPE), by one warp of the
// item's split 0. Any time will do: the kernel reads a sequence's last key from k_new / k_rot,
// never from its cache row.
template <class T, int D>
__device__ __forceinline__ void store_step_rows(const PagedDecode& a, int kv_head, int b, const T* k_rot, int lane) {
  if (!a.k_new || lane >= D / 8 || a.seq_lens[b] < 1) return;
  const int slot = a.slots[b];
  if (slot < 0) return;
  const T* k_new = static_cast<const T*>(a.k_new) + b * a.k_new_stride + kv_head * D;
  const T* v_new = static_cast<const T*>(a.v_new) + b * a.v_new_stride + kv_head * D;
  const int64_t at = static_cast<int64_t>(slot) * a.kv_heads * D + kv_head * D + lane * 8;
  reinterpret_cast<uint4*>(static_cast<T*>(a.k_cache) + at)[0] =
      reinterpret_cast<const uint4*>((a.rope_cos ? k_rot : k_new) + lane * 8)[0];
  reinterpret_cast<uint4*>(static_cast<T*>(a.v_cache) + at)[0] = reinterpret_cast<const uint4*>(v_new + lane * 8)[0];
}

// A one-warp item's result, as store_merged writes a merge of one part: the output (o / l, or 0
// for a row without keys) with one split, else the split's output and log-sum-exp in the workspace.
template <class T, int D>
__device__ __forceinline__ void store_warp(const PagedDecode& a, int kv_head, int b, int split, int lane,
                                           const float (&o)[D / 8][4], float m_lo, float m_hi, float l_lo,
                                           float l_hi) {
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_lo += __shfl_xor_sync(kFull, l_lo, off);
    l_hi += __shfl_xor_sync(kFull, l_hi, off);
  }
  const int group = static_cast<int>(a.heads / a.kv_heads), splits = static_cast<int>(a.splits);
  const int r = lane / 4, c2 = 2 * (lane % 4);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = r + 8 * half;
    if (row >= group) continue;
    const float m = half ? m_hi : m_lo, l = half ? l_hi : l_lo;
    const int64_t bh = static_cast<int64_t>(b) * a.heads + kv_head * group + row;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float v0 = l > 0.f ? o[n][2 * half] / l : 0.f, v1 = l > 0.f ? o[n][2 * half + 1] / l : 0.f;
      if (splits == 1) {
        *reinterpret_cast<uint32_t*>(static_cast<T*>(a.out) + bh * D + n * 8 + c2) = pack2<T>(v0, v1);
      } else {
        float* ws = a.workspace + (bh * splits + split) * D + n * 8 + c2;
        ws[0] = v0;
        ws[1] = v1;
      }
    }
    if (splits > 1 && lane % 4 == 0)
      a.workspace[a.batch * a.heads * splits * D + bh * splits + split] = l > 0.f ? m + log2f(l) : -INFINITY;
  }
}

// Block (KV head, sequence, split). Its item runs on its 4 warps, which merge their states through
// shared memory; but an item of at most a.pack_keys keys in the split (a short context: the 4
// warps' fixed costs would outweigh their share of the tiles) runs on one warp, in the block of
// the item numbered (sequence x KV heads + KV head) down to a multiple of 4, whose warp w serves
// that item + w. Which items pack is read from the lengths on the device, so a captured graph
// serves every length.
template <class T, int D, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm<D>) paged_decode_mma_kernel(PagedDecode a) {
  constexpr int kTileBytes = kKeys * D * 2;
  constexpr int kStages = detail::kStagesOf<D>;
  static_assert(kWarps * kTileRows * (D + 2) * 4 <= kSmemBytes<D>, "the merge reuses the pipeline's memory");
  static_assert(kWarps * kTileRows * (D + 2) * 4 <= kFp8SmemTotal<D>, "the merge reuses the pipeline's memory");
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_heads = static_cast<int>(gridDim.x), split = static_cast<int>(blockIdx.z);
  const int item = static_cast<int>(blockIdx.y) * kv_heads + static_cast<int>(blockIdx.x);
  const int items = kv_heads * static_cast<int>(gridDim.y);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) +
                        warp * (kFp8 ? kFp8WarpBytes<D> : kStages * 2 * kTileBytes);
  // With RoPE: each warp's copy of the step's key, rotated, past the pipeline's memory.
  T* k_rot = reinterpret_cast<T*>(smem + kSmemBytes<D>) + warp * D;
  auto packs = [&](int b) {
    if (a.pack_keys <= 0) return false;
    const SplitRange range = split_range(a, b, split, kKeys);
    return range.hi - range.lo <= a.pack_keys;
  };
  float o[D / 8][4];
  float m_lo, m_hi, l_lo, l_hi;
  const bool wide = !packs(static_cast<int>(blockIdx.y));  // block-uniform
  if (wide) {
    const int kv_head = static_cast<int>(blockIdx.x), b = static_cast<int>(blockIdx.y);
    attend<T, D, kFp8>(a, kv_head, b, split, warp, kWarps, base, k_rot, o, m_lo, m_hi, l_lo, l_hi);
    __syncthreads();
    // Merge the warps through shared memory.
    const PartStates st = part_states(smem);
    stash_part<D>(st, warp, lane, o, m_lo, m_hi, l_lo, l_hi);
    __syncthreads();
    const int group = static_cast<int>(a.heads / a.kv_heads);
    store_merged<T, D>(a, st.m, st.l, st.acc, kWarps, kTileRows, group, kv_head * group, b, split);
    if (split == 0 && warp == 0) store_step_rows<T, D>(a, kv_head, b, k_rot, lane);
  }
  if (a.pack_keys <= 0 || item % kWarps != 0) return;
  if (wide) __syncthreads();  // the merge has read its shared memory before the pipelines refill it
  const int mine = item + warp;
  if (mine >= items) return;
  const int kv_head = mine % kv_heads, b = mine / kv_heads;
  if (!packs(b)) return;  // its own block serves it
  attend<T, D, kFp8>(a, kv_head, b, split, 0, 1, base, k_rot, o, m_lo, m_hi, l_lo, l_hi);
  __syncwarp();
  store_warp<T, D>(a, kv_head, b, split, lane, o, m_lo, m_hi, l_lo, l_hi);
  if (split == 0) store_step_rows<T, D>(a, kv_head, b, k_rot, lane);
}


template <class T, int D, bool kFp8>
void launch(const PagedDecode& a, cudaStream_t stream) {
  constexpr int kSmem = kFp8 ? kFp8SmemTotal<D> : kSmemTotal<D>;
  if constexpr (kSmem > 48 * 1024) {
    static bool done[64] = {};
    reserve_shared_memory(paged_decode_mma_kernel<T, D, kFp8>, kSmem, done, "paged decode attention");
  }
  const dim3 grid(static_cast<unsigned>(a.kv_heads), static_cast<unsigned>(a.batch), static_cast<unsigned>(a.splits));
  paged_decode_mma_kernel<T, D, kFp8><<<grid, kWarps * 32, kSmem, stream>>>(a);
  check_launch("paged decode attention (tensor cores)");
  launch_combine<T>(a, stream);
}

template <class T, bool kFp8>
void dispatch_dim(const PagedDecode& a, cudaStream_t stream) {
  if (a.head_dim == 64) return launch<T, 64, kFp8>(a, stream);
  return launch<T, 128, kFp8>(a, stream);
}
template <class T>
void dispatch_cache(const PagedDecode& a, cudaStream_t stream) {
  if (a.cache_fp8) return dispatch_dim<T, true>(a, stream);
  dispatch_dim<T, false>(a, stream);
}

}  // namespace

bool paged_decode_mma_serves(DType dtype, int64_t head_dim, int64_t group) {
  return dtype != DType::kFloat && (head_dim == 64 || head_dim == 128) && group >= 2 && group <= kTileRows;
}

bool paged_decode_mma(const PagedDecode& a, cudaStream_t stream) {
  if (a.rope_cos && !(a.rope_sin && a.k_new && a.v_new))
    throw std::invalid_argument("paged decode attention: RoPE tables need both tables and this step's K/V rows");
  if (!paged_decode_mma_serves(a.dtype, a.head_dim, a.heads / a.kv_heads)) return false;
  if (a.dtype == DType::kBFloat16)
    dispatch_cache<__nv_bfloat16>(a, stream);
  else
    dispatch_cache<__half>(a, stream);
  return true;
}

}  // namespace tiller::model::cuda::detail
