// FP8 (e4m3) quantization of activations per token and group of 128 features (a block per 64
// rows of a group, four threads a row), per token (one block per row), per tensor (its maximum,
// then the codes for a given scale), and of 128x128 tiles (each block looping over tiles, the next
// one's copies in flight: the FP8 training's weights and transposed operands, and tensor scaling's
// two layouts of one tensor from one read); kernels.h. The training kernels divide by a scale
// through its reciprocal (Fp8Divider: the same codes as the division).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "model/cuda/convert.cuh"
#include "model/cuda/fp8_codes.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int kGroup = 128;
// quantize_tiles_fp8's modes (kernels.h), x^T with one given scale for the whole tensor
// (quantize_scaled_transposed_fp8), and x^T and x with it from one read (quantize_scaled_both_fp8)
constexpr int kTile = 0, kTileTransposed = 1, kColumnsTransposed = 2, kTensorTransposed = 3, kTensorBoth = 4;
constexpr int kTileModes = 5;

// The largest magnitude of a pack's values, from the packed values themselves (bf16x2 / fp16x2
// maxima: no fp32 copy of the pack stays live). Like fmaxf, a maximum passes NaNs over.
template <class T, int kVec>
__device__ __forceinline__ float pack_amax(const Pack<T, kVec>& p) {
  if constexpr (std::is_same_v<T, float>) {
    float a = 0.f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) a = fmaxf(a, fabsf(p.v[j]));
    return a;
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const T2* two = reinterpret_cast<const T2*>(p.v);
    T2 m = __habs2(two[0]);
#pragma unroll
    for (int j = 1; j < kVec / 2; ++j) m = __hmax2(m, __habs2(two[j]));
    return fmaxf(0.f, fmaxf(to_f(m.x), to_f(m.y)));
  }
}

// Four codes of a pack's values from `first`, as one 32-bit word (the first in its low byte).
template <class T, int kVec>
__device__ __forceinline__ uint32_t pack_codes4(const Pack<T, kVec>& p, int first, const Fp8Divider& d) {
  constexpr int kC = kQuotientCorrections<T>;
  return d.code2<kC>(to_f(p.v[first]), to_f(p.v[first + 1])) |
         d.code2<kC>(to_f(p.v[first + 2]), to_f(p.v[first + 3])) << 16;
}

// A block of 256 threads quantizes 64 rows of one group: four threads a row, 32 values each (16-byte
// loads where the layout allows them, kVecLoads; else value by value), the group's largest magnitude
// over the four, and 32 codes a thread (two 16-byte stores, kVecStores; else 4-byte ones). The
// threads of a row read 256 contiguous bytes; the block's scales are 64 consecutive floats.
constexpr int kGroupRowsPerBlock = 64, kGroupThreadValues = kGroup / 4;
template <class T, bool kVecLoads, bool kVecStores>
__global__ void __launch_bounds__(256) quantize_groups_kernel(const T* x, int64_t rows, int64_t padded_rows, int64_t k,
                                                              int64_t x_stride, uint8_t* q, int64_t q_stride,
                                                              float* scale, int64_t scale_stride) {
  constexpr int kVec = 16 / sizeof(T), kPacks = kGroupThreadValues / kVec;
  const int64_t r = blockIdx.x * static_cast<int64_t>(kGroupRowsPerBlock) + threadIdx.x / 4;
  const int64_t g = blockIdx.y;
  const int64_t col = g * kGroup + (threadIdx.x % 4) * kGroupThreadValues;
  Pack<T, kVec> p[kPacks];
  if (kVecLoads && r < rows && col + kGroupThreadValues <= k) {
#pragma unroll
    for (int i = 0; i < kPacks; ++i) p[i] = *reinterpret_cast<const Pack<T, kVec>*>(x + r * x_stride + col + i * kVec);
  } else {
#pragma unroll
    for (int i = 0; i < kGroupThreadValues; ++i) {
      const int64_t c = col + i;
      p[i / kVec].v[i % kVec] = r < rows && c < k ? x[r * x_stride + c] : from_f<T>(0.f);
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPacks; ++i) amax = fmaxf(amax, pack_amax(p[i]));
  // The four threads of a row are lanes 4m .. 4m + 3; every lane takes part (no early exit).
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  if (r >= padded_rows) return;
  const Fp8Divider d(fp8_scale(amax));
  uint8_t* out = q + r * q_stride + col;
#pragma unroll
  for (int i = 0; i < kGroupThreadValues / 16; ++i) {
    uint32_t w[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int first = 16 * i + 4 * b;
      w[b] = pack_codes4(p[first / kVec], first % kVec, d);
    }
    if (kVecStores) {
      reinterpret_cast<uint4*>(out)[i] = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b) reinterpret_cast<uint32_t*>(out)[4 * i + b] = w[b];
    }
  }
  if (threadIdx.x % 4 == 0) scale[g * scale_stride + r] = d.s;
}

// One block per row: the row's largest magnitude by a block reduction, then the values again
// (from L2), kVec per thread and step: one 16-byte load (kVec = 16 / sizeof(T)) and one store of
// kVec bytes when the row allows it, else kVec = 1.
template <class T, int kVec>
__global__ void quantize_rows_kernel(const T* x, int64_t rows, int64_t k, int64_t x_stride, uint8_t* q,
                                     int64_t q_stride, float* scale) {
  using P = Pack<T, kVec>;
  __shared__ float partial[32];
  const int64_t r = blockIdx.x;
  const bool live = r < rows;
  const T* row = x + r * x_stride;
  float amax = 0.f;
  if (live)
    for (int64_t j = kVec * static_cast<int64_t>(threadIdx.x); j < k; j += kVec * static_cast<int64_t>(blockDim.x)) {
      const P v = *reinterpret_cast<const P*>(row + j);
#pragma unroll
      for (int i = 0; i < kVec; ++i) amax = fmaxf(amax, fabsf(to_f(v.v[i])));
    }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    amax = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (threadIdx.x == 0) partial[0] = amax;
  }
  __syncthreads();
  amax = partial[0];
  const float s = fp8_scale(amax);
  // Whole vectors up to q_stride (a multiple of kVec): past k (or a padding row) they are zeros.
  for (int64_t j = kVec * static_cast<int64_t>(threadIdx.x); j < q_stride;
       j += kVec * static_cast<int64_t>(blockDim.x)) {
    Pack<uint8_t, kVec> out;
    if (live && j < k) {
      const P v = *reinterpret_cast<const P*>(row + j);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out.v[i] = fp8_code(to_f(v.v[i]), s);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) out.v[i] = 0;
    }
    *reinterpret_cast<Pack<uint8_t, kVec>*>(q + r * q_stride + j) = out;
  }
  if (threadIdx.x == 0) scale[r] = s;
}

// 16-byte copies global -> shared that run while the block computes (cp.async, bypassing L1);
// `valid` false zero-fills the 16 bytes without reading.
__device__ __forceinline__ void copy_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// The tile kernel's codes of x in x's layout (kTensorBoth): q [rows, cols] at `stride`, past x's
// extents zeros; rows and cols within the padded tiles, cols a multiple of the vector width.
struct DirectCodes {
  uint8_t* q = nullptr;
  int64_t rows = 0, cols = 0, stride = 0;
};

// Waits until all but the most recent group of copies have landed.
__device__ __forceinline__ void copy_async_wait_previous() { asm volatile("cp.async.wait_group 1;\n" ::); }

// 128x128 tiles of x, each block looping over tiles id = blockIdx.x, + gridDim.x, ... (tile row
// id / tiles_c, column id % tiles_c) with two tile buffers in shared memory: the next tile's
// 16-byte copies (kAsync: rows whose vectors are whole and aligned; else values loaded one by one)
// land while the current one is quantized. A tile row is copied by 128 / kVec threads, 16 (bf16) or
// 8 (fp32) rows a pass. kTile reads the tile back in the same layout (conflict-free 16-byte reads)
// and writes codes in x's layout; the transposed modes stage the tile swizzled, read pairs of
// columns over 16 rows a thread (a warp: 4 pairs of 8 rows at once, on distinct banks) and write
// each column's 16 rows as 16 contiguous codes of its output row (16-byte stores where q's rows
// are 16-byte aligned: `wide`; a warp's store fills 128-byte lines). The scale is the tile's (a
// block reduction), each column's (kColumnsTransposed: over the thread's rows, then the warp's
// lanes that hold the column) or the tensor's, given (kTensorTransposed, kTensorBoth:
// *tensor_scale). kTensorBoth also writes x's codes in x's layout (`direct`) from the thread's own
// vectors of the staged tile, before the transposed reads. Dynamic shared memory: 2 x 128 x 128
// values of T.
template <class T, bool kAsync, int kMode>
__global__ void __launch_bounds__(256, 3)
    quantize_tiles_kernel(const T* x, int64_t rows, int64_t cols, int64_t x_stride, int64_t tiles_c, int64_t tiles,
                          uint8_t* q, int64_t q_stride, bool wide, float* scale, int64_t scale_stride,
                          const float* tensor_scale, DirectCodes direct) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kRowThreads = kGroup / kVec;       // threads that copy one tile row
  constexpr int kRowsPerPass = 256 / kRowThreads;  // tile rows copied per pass
  constexpr int kPasses = kGroup / kRowsPerPass;   // vectors per thread
  extern __shared__ __align__(16) unsigned char tile_bytes[];
  const int t = threadIdx.x, lr = t / kRowThreads, lc = (t % kRowThreads) * kVec;
  T* const buffers = reinterpret_cast<T*>(tile_bytes);  // [2][kGroup][kGroup]
  // The transposed modes store a row's 16-byte chunks XOR-swizzled by its 16-row band: chunk c of
  // row r at c ^ ((r / 16) % 8 * sizeof(T) / 2), so that the 8 rows a warp reads at once (16
  // apart) fall on distinct banks (two-byte values; fp32's 256 bytes take two wavefronts, the
  // fewest). kTile keeps x's layout.
  const auto swizzled_chunk = [](int row, int chunk) {
    return kMode == kTile ? chunk : chunk ^ ((row >> 4) & 7) * static_cast<int>(sizeof(T) / 2);
  };

  const auto load = [&](int64_t id, T* dst) {
    const int64_t tr = id / tiles_c, tc = id % tiles_c;
    const int64_t col = tc * kGroup + lc;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int rr = i * kRowsPerPass + lr;
      const int64_t row = tr * kGroup + rr;
      T* d = dst + rr * kGroup + swizzled_chunk(rr, lc / kVec) * kVec;
      if constexpr (kAsync) {
        const bool in = row < rows && col < cols;  // cols % kVec == 0: a vector is wholly in or out
        copy_async16(d, in ? x + row * x_stride + col : x, in);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          d[j] = row < rows && col + j < cols ? x[row * x_stride + col + j] : from_f<T>(0.f);
      }
    }
    if constexpr (kAsync) copy_async_commit();
  };
  // The largest magnitude of the thread's vectors of the tile (the layout they were copied in).
  const auto vectors_amax = [&](const T* tile) {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < kPasses; ++i)
      a = fmaxf(a, pack_amax(*reinterpret_cast<const Pack<T, kVec>*>(tile + (i * kRowsPerPass + lr) * kGroup + lc)));
    return a;
  };

  int64_t id = blockIdx.x;
  if (id < tiles) load(id, buffers);
  for (int it = 0; id < tiles; id += gridDim.x, ++it) {
    const T* tile = buffers + (it & 1) * kGroup * kGroup;
    const int64_t tr = id / tiles_c, tc = id % tiles_c;
    if (id + gridDim.x < tiles) load(id + gridDim.x, buffers + ((it + 1) & 1) * kGroup * kGroup);
    else if (kAsync) copy_async_commit();  // an empty group: the wait below still means this tile
    if constexpr (kAsync) copy_async_wait_previous();
    __syncthreads();
    if constexpr (kMode == kTile) {
      const Fp8Divider d(fp8_scale(block_max(vectors_amax(tile))));
      uint8_t* out = q + (tr * kGroup + lr) * q_stride + tc * kGroup + lc;
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        const auto& p = *reinterpret_cast<const Pack<T, kVec>*>(tile + (i * kRowsPerPass + lr) * kGroup + lc);
        uint8_t* o = out + i * kRowsPerPass * q_stride;
        if constexpr (kVec == 8)
          *reinterpret_cast<uint2*>(o) = make_uint2(pack_codes4(p, 0, d), pack_codes4(p, 4, d));
        else
          *reinterpret_cast<uint32_t*>(o) = pack_codes4(p, 0, d);
      }
      if (t == 0) scale[tr * scale_stride + tc] = d.s;
    } else {
      // Lane p + 4s of warp g takes the rows 16s .. 16s + 15 of two column pairs, 16g + 2p + 8h for
      // h = 0, 1, one pair at a time: the warp reads 4 consecutive pairs of each of 8 rows at once
      // (on distinct banks: the swizzle). It writes each column's 16 codes as 16 contiguous bytes
      // of its output row: a warp's store fills whole 128-byte lines of 4 output rows.
      constexpr int kRows = kGroup / 8;
      constexpr int kC = kQuotientCorrections<T>;
      const int lane = t % 32, s = lane / 4, first = 16 * (t / 32) + 2 * (lane % 4);
      uint8_t* const out_base = q + (tc * kGroup) * q_stride + tr * kGroup + kRows * s;
      float one = 1.f;  // the tile's or the tensor's scale
      if constexpr (kMode == kTensorTransposed || kMode == kTensorBoth)
        one = *tensor_scale;
      if constexpr (kMode == kTensorBoth) {
        // x's codes in x's layout: the thread's vectors as it copied them (a tile row's 16 or 32
        // threads write its 128 codes side by side), within direct's extents (whole vectors).
        const Fp8Divider d(one);
        const int64_t col = tc * kGroup + lc;
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
          const int rr = i * kRowsPerPass + lr;
          const int64_t row = tr * kGroup + rr;
          if (row >= direct.rows || col >= direct.cols) continue;
          const auto& p = *reinterpret_cast<const Pack<T, kVec>*>(tile + rr * kGroup + swizzled_chunk(rr, lc / kVec) * kVec);
          uint8_t* const o = direct.q + row * direct.stride + col;
          if constexpr (kVec == 8)
            *reinterpret_cast<uint2*>(o) = make_uint2(pack_codes4(p, 0, d), pack_codes4(p, 4, d));
          else
            *reinterpret_cast<uint32_t*>(o) = pack_codes4(p, 0, d);
        }
      }
      else if constexpr (kMode == kTileTransposed)
        one = fp8_scale(block_max(vectors_amax(tile)));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = first + 8 * h;
        const T* const base = tile + kRows * s * kGroup + swizzled_chunk(kRows * s, col / kVec) * kVec + col % kVec;
        Pack<T, 2> v[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) v[i] = *reinterpret_cast<const Pack<T, 2>*>(base + i * kGroup);
        float sc[2] = {one, one};
        if constexpr (kMode == kColumnsTransposed) {
          // Each column's largest magnitude over the thread's 16 rows, then over the 8 lanes of
          // the warp that hold the same columns (lanes 4 apart).
          float a[2];
          if constexpr (sizeof(T) == 2) {  // pairwise maxima of the packed pairs (as pack_amax)
            using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
            T2 m = __habs2(*reinterpret_cast<const T2*>(v[0].v));
#pragma unroll
            for (int i = 1; i < kRows; ++i) m = __hmax2(m, __habs2(*reinterpret_cast<const T2*>(v[i].v)));
            a[0] = fmaxf(0.f, to_f(m.x));
            a[1] = fmaxf(0.f, to_f(m.y));
          } else {
            a[0] = a[1] = 0.f;
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
              a[0] = fmaxf(a[0], fabsf(v[i].v[0]));
              a[1] = fmaxf(a[1], fabsf(v[i].v[1]));
            }
          }
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int off = 4; off < 32; off *= 2) a[j] = fmaxf(a[j], __shfl_xor_sync(0xffffffffu, a[j], off));
            sc[j] = fp8_scale(a[j]);
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const Fp8Divider d(sc[j]);
          uint32_t w[4];
#pragma unroll
          for (int b = 0; b < 4; ++b)
            w[b] = d.code2<kC>(to_f(v[4 * b].v[j]), to_f(v[4 * b + 1].v[j])) |
                   d.code2<kC>(to_f(v[4 * b + 2].v[j]), to_f(v[4 * b + 3].v[j])) << 16;
          uint8_t* const out = out_base + (col + j) * q_stride;
          if (wide) {
            *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
          } else {
            reinterpret_cast<uint2*>(out)[0] = make_uint2(w[0], w[1]);
            reinterpret_cast<uint2*>(out)[1] = make_uint2(w[2], w[3]);
          }
          if (kMode == kColumnsTransposed && s == 0) scale[tr * scale_stride + tc * kGroup + col + j] = sc[j];
        }
      }
      if (kMode == kTileTransposed && t == 0) scale[tc * scale_stride + tr] = one;
    }
    __syncthreads();  // the tile's buffer takes the copies of two tiles on
  }
}

// The largest magnitude of a vector of kVec values (pack_amax; fabsf for single values).
template <class T, int kVec>
__device__ __forceinline__ float vector_amax(const Pack<T, kVec>& p) {
  if constexpr (kVec == 1)
    return fmaxf(0.f, fabsf(to_f(p.v[0])));
  else
    return pack_amax(p);
}

// Per-tensor scaling, pass 1: each block's largest magnitude into partial[blockIdx.x]. `flat` (rows
// of x back to back: rows x per_row vectors of kVec values as one run): four vectors in flight a
// thread; else rows of `per_row` vectors at x_stride, a block per row at a time.
template <class T, int kVec>
__global__ void __launch_bounds__(256) tensor_amax_kernel(const T* x, int64_t rows, int64_t per_row,
                                                          int64_t x_stride, bool flat, float* partial) {
  using P = Pack<T, kVec>;
  const P* v = reinterpret_cast<const P*>(x);
  float a = 0.f;
  if (flat) {
    const int64_t n = rows * per_row, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
      const P v0 = v[i], v1 = v[i + stride], v2 = v[i + 2 * stride], v3 = v[i + 3 * stride];
      a = fmaxf(a, fmaxf(fmaxf(vector_amax(v0), vector_amax(v1)), fmaxf(vector_amax(v2), vector_amax(v3))));
    }
    for (; i < n; i += stride) a = fmaxf(a, vector_amax(v[i]));
  } else {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
      const P* row = reinterpret_cast<const P*>(x + r * x_stride);
      for (int64_t j = threadIdx.x; j < per_row; j += blockDim.x) a = fmaxf(a, vector_amax(row[j]));
    }
  }
  a = block_max(a);
  if (threadIdx.x == 0) partial[blockIdx.x] = a;
}

// Pass 2: the tensor's scale from the `parts` partial maxima, by one block.
__global__ void __launch_bounds__(256) tensor_scale_kernel(const float* partial, int parts, float* scale) {
  float a = 0.f;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) a = fmaxf(a, partial[i]);
  a = block_max(a);
  if (threadIdx.x == 0) *scale = fp8_scale(a);
}

// The codes of [padded_rows, q_stride] with the scale *scale (zeros past rows and k), kVec values
// a thread and step: block (bx, by) takes 256 vectors of rows by, by + gridDim.y, ...
template <class T, int kVec>
__global__ void __launch_bounds__(256) quantize_scaled_kernel(const T* x, int64_t rows, int64_t padded_rows, int64_t k,
                                                              int64_t x_stride, uint8_t* q, int64_t q_stride,
                                                              const float* scale) {
  using P = Pack<T, kVec>;
  constexpr int kC = kQuotientCorrections<T>;
  const Fp8Divider d(*scale);
  const int64_t c = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * kVec;
  if (c >= q_stride) return;
  for (int64_t r = blockIdx.y; r < padded_rows; r += gridDim.y) {
    uint8_t* out = q + r * q_stride + c;
    if (r < rows && c < k) {
      const P v = *reinterpret_cast<const P*>(x + r * x_stride + c);
      if constexpr (kVec == 8) {
        *reinterpret_cast<uint2*>(out) = make_uint2(pack_codes4(v, 0, d), pack_codes4(v, 4, d));
      } else if constexpr (kVec == 4) {
        *reinterpret_cast<uint32_t*>(out) = pack_codes4(v, 0, d);
      } else {
        out[0] = d.code<kC>(to_f(v.v[0]));
      }
    } else {
      Pack<uint8_t, kVec> zero;
#pragma unroll
      for (int j = 0; j < kVec; ++j) zero.v[j] = 0;
      *reinterpret_cast<Pack<uint8_t, kVec>*>(out) = zero;
    }
  }
}

// y = T(y * scale[row] (+ bias[col])) in place, kVec values at a time (kVec divides n and the row
// stride): fp32 product, then fp32 sum, each rounded on its own (no fused multiply-add), as the
// CPU's ATen ops compute them.
template <class T, int kVec>
__global__ void scale_rows_kernel(T* y, int64_t rows, int64_t n, int64_t y_stride, const float* scale,
                                  const T* bias) {
  using P = Pack<T, kVec>;
  const int64_t per_row = n / kVec, total = rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * kVec;
    P* at = reinterpret_cast<P*>(y + r * y_stride + c);
    P v = *at;
    const float s = scale[r];
    if (bias != nullptr) {
      const P b = *reinterpret_cast<const P*>(bias + c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v.v[j] = from_f<T>(__fadd_rn(__fmul_rn(to_f(v.v[j]), s), to_f(b.v[j])));
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v.v[j] = from_f<T>(__fmul_rn(to_f(v.v[j]), s));
    }
    *at = v;
  }
}

}  // namespace

void quantize_rows_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                       void* q, int64_t q_stride, float* scale, void* stream) {
  if (q_stride < k || q_stride % 4 != 0 || reinterpret_cast<uintptr_t>(q) % 4 != 0 || padded_rows < rows ||
      padded_rows > 2147483647)
    throw std::invalid_argument("quantize_rows_fp8: q must hold every column in 4-byte aligned rows");
  if (padded_rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = k % kVec == 0 && x_stride % kVec == 0 && q_stride % kVec == 0 &&
                     reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % kVec == 0;
    const auto blocks = static_cast<unsigned>(padded_rows);
    if (vec)
      quantize_rows_kernel<T, kVec><<<blocks, 512, 0, s>>>(static_cast<const T*>(x), rows, k, x_stride,
                                                           static_cast<uint8_t*>(q), q_stride, scale);
    else
      quantize_rows_kernel<T, 1><<<blocks, 512, 0, s>>>(static_cast<const T*>(x), rows, k, x_stride,
                                                        static_cast<uint8_t*>(q), q_stride, scale);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("fp8 row quantize kernel launch: ") + cudaGetErrorString(err));
}

void quantize_groups_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, int64_t groups, float* scale, int64_t scale_stride, void* stream) {
  if (groups * kGroup < k || q_stride < groups * kGroup || q_stride % 4 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 4 != 0 || padded_rows < rows || scale_stride < padded_rows)
    throw std::invalid_argument("quantize_groups_fp8: q must hold whole groups in 4-byte aligned rows, and the "
                                "scales every padded row");
  if (groups > 65535)
    throw std::invalid_argument("quantize_groups_fp8: " + std::to_string(groups) +
                                " groups of 128 a row; at most 65535 (8,388,480 features)");
  if (padded_rows == 0 || groups == 0) return;
  const dim3 grid(static_cast<unsigned>((padded_rows + kGroupRowsPerBlock - 1) / kGroupRowsPerBlock),
                  static_cast<unsigned>(groups));
  const auto s = static_cast<cudaStream_t>(stream);
  const bool wide = q_stride % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = k % kVec == 0 && x_stride % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const auto launch = [&](auto kernel) {
      kernel<<<grid, 256, 0, s>>>(static_cast<const T*>(x), rows, padded_rows, k, x_stride, static_cast<uint8_t*>(q),
                                  q_stride, scale, scale_stride);
    };
    if (vec && wide) launch(quantize_groups_kernel<T, true, true>);
    else if (vec) launch(quantize_groups_kernel<T, true, false>);
    else if (wide) launch(quantize_groups_kernel<T, false, true>);
    else launch(quantize_groups_kernel<T, false, false>);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("fp8 quantize kernel launch: ") + cudaGetErrorString(err));
}

namespace {

// Blocks of the tile kernel that fit a multiprocessor at once, times the multiprocessors: asked of
// the runtime once per kernel and device (with the shared-memory reservation), then kept.
struct TileLaunch {
  bool reserved[64] = {};
  int blocks[64] = {};
};
template <class Kernel>
int64_t resident_blocks(Kernel kernel, int tile_bytes, TileLaunch& l) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) throw std::runtime_error("quantize_tiles_fp8: cudaGetDevice failed");
  const bool cached = device >= 0 && device < 64;
  if (cached && l.blocks[device] > 0) return l.blocks[device];
  reserve_shared_memory(kernel, tile_bytes, l.reserved, "quantize_tiles_fp8");
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0)
    throw std::runtime_error("quantize_tiles_fp8: cannot read the device's multiprocessor count");
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, tile_bytes) != cudaSuccess || per_sm <= 0)
    throw std::runtime_error("quantize_tiles_fp8: no block of the tile kernel fits a multiprocessor");
  if (cached) l.blocks[device] = per_sm * sms;
  return static_cast<int64_t>(per_sm) * sms;
}

// The tile kernel in `mode` (kTile .. kTensorTransposed) over x [rows, cols] padded to [padded_rows,
// padded_cols]; `tensor_scale`: kTensorTransposed's scale (device memory).
void launch_tiles(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride, int64_t padded_rows,
                  int64_t padded_cols, int mode, void* q, int64_t q_stride, float* scale, int64_t scale_stride,
                  const float* tensor_scale, cudaStream_t s, DirectCodes direct = {}) {
  const int64_t tiles = (padded_rows / kGroup) * (padded_cols / kGroup);
  const bool wide = q_stride % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kVec = 16 / sizeof(T);
    // Two tile buffers: 64 KiB of two-byte values, 128 KiB of fp32 (above the default 48 KiB:
    // reserved once per device). The grid: as many blocks as fit at once, each looping over tiles.
    const int tile_bytes = 2 * kGroup * kGroup * static_cast<int>(sizeof(T));
    const bool async = cols % kVec == 0 && x_stride % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    static TileLaunch launches[2][kTileModes];  // by async and mode (and, through the lambda, T)
    TileLaunch& l = launches[async][mode];
    const auto launch = [&](auto kernel) {
      const auto blocks = static_cast<unsigned>(std::min<int64_t>(tiles, resident_blocks(kernel, tile_bytes, l)));
      kernel<<<blocks, 256, tile_bytes, s>>>(static_cast<const T*>(x), rows, cols, x_stride, padded_cols / kGroup,
                                             tiles, static_cast<uint8_t*>(q), q_stride, wide, scale, scale_stride,
                                             tensor_scale, direct);
    };
    const auto pick = [&](auto async_c) {
      constexpr bool A = decltype(async_c)::value;
      switch (mode) {
        case kTile: launch(quantize_tiles_kernel<T, A, kTile>); break;
        case kTileTransposed: launch(quantize_tiles_kernel<T, A, kTileTransposed>); break;
        case kColumnsTransposed: launch(quantize_tiles_kernel<T, A, kColumnsTransposed>); break;
        case kTensorTransposed: launch(quantize_tiles_kernel<T, A, kTensorTransposed>); break;
        default: launch(quantize_tiles_kernel<T, A, kTensorBoth>); break;
      }
    };
    if (async)
      pick(std::true_type());
    else
      pick(std::false_type());
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("fp8 tile quantize kernel launch: ") + cudaGetErrorString(err));
}

// The extents' checks the tile launchers share.
void check_tiles(const char* what, int64_t rows, int64_t cols, int64_t padded_rows, int64_t padded_cols, void* q,
                 int64_t q_stride, int64_t out_cols) {
  if (padded_rows % kGroup != 0 || padded_cols % kGroup != 0 || padded_rows < rows || padded_cols < cols ||
      q_stride < out_cols || q_stride % 8 != 0 || reinterpret_cast<uintptr_t>(q) % 8 != 0)
    throw std::invalid_argument(std::string(what) + ": the padded extents must be whole tiles that q (8-byte "
                                "aligned rows) holds");
  // Tile ids are int64; a tile row or column index stays far inside it.
  if (padded_rows / kGroup > 2147483647 || padded_cols / kGroup > 2147483647)
    throw std::invalid_argument(std::string(what) + ": more than 2^31 tiles along an axis");
}

}  // namespace

void quantize_tiles_fp8(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                        int64_t padded_rows, int64_t padded_cols, Fp8Tiles mode, void* q, int64_t q_stride,
                        float* scale, int64_t scale_stride, void* stream) {
  const bool transposed = mode != Fp8Tiles::kTile;
  check_tiles("quantize_tiles_fp8", rows, cols, padded_rows, padded_cols, q, q_stride,
              transposed ? padded_rows : padded_cols);
  const int64_t tiles_r = padded_rows / kGroup, tiles_c = padded_cols / kGroup;
  const int64_t scale_rows = mode == Fp8Tiles::kTile ? tiles_c : mode == Fp8Tiles::kTileTransposed ? tiles_r
                                                                                                   : padded_cols;
  if (scale_stride < scale_rows)
    throw std::invalid_argument("quantize_tiles_fp8: a scale row of " + std::to_string(scale_stride) +
                                " floats cannot hold " + std::to_string(scale_rows));
  if (tiles_r == 0 || tiles_c == 0) return;
  launch_tiles(dtype, x, rows, cols, x_stride, padded_rows, padded_cols, static_cast<int>(mode), q, q_stride, scale,
               scale_stride, nullptr, static_cast<cudaStream_t>(stream));
}

void tensor_scale_fp8(DType dtype, const void* x, int64_t rows, int64_t k, int64_t x_stride, float* partial,
                      float* scale, void* stream) {
  if (rows < 0 || k < 0 || (rows > 1 && x_stride < k))
    throw std::invalid_argument("tensor_scale_fp8: the row stride is shorter than a row");
  const auto s = static_cast<cudaStream_t>(stream);
  constexpr int kThreads = 256;
  int parts = 1;
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = k % kVec == 0 && x_stride % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const bool flat = x_stride == k || rows <= 1;
    const auto launch = [&](auto vec_width) {
      constexpr int V = decltype(vec_width)::value;
      const int64_t per_row = k / V, n = rows * per_row;
      const int64_t blocks = flat ? (n + 4 * kThreads - 1) / (4 * kThreads) : rows;
      parts = static_cast<int>(std::clamp<int64_t>(blocks, 1, kFp8TensorParts));
      tensor_amax_kernel<T, V><<<parts, kThreads, 0, s>>>(static_cast<const T*>(x), rows, per_row, x_stride, flat,
                                                           partial);
    };
    if (vec)
      launch(std::integral_constant<int, kVec>());
    else
      launch(std::integral_constant<int, 1>());
  });
  tensor_scale_kernel<<<1, kThreads, 0, s>>>(partial, parts, scale);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8 tensor scale kernel launch: ") + cudaGetErrorString(err));
}

void fp8_scale_of_partials(const float* partial, int parts, float* scale, void* stream) {
  if (parts < 0 || parts > kFp8TensorParts || (parts > 0 && partial == nullptr))
    throw std::invalid_argument("fp8_scale_of_partials: between 0 and kFp8TensorParts partial maxima");
  tensor_scale_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(partial, parts, scale);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8 tensor scale kernel launch: ") + cudaGetErrorString(err));
}

void quantize_scaled_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, const float* scale, void* stream) {
  if (q_stride < k || q_stride % 4 != 0 || reinterpret_cast<uintptr_t>(q) % 4 != 0 || padded_rows < rows)
    throw std::invalid_argument("quantize_scaled_fp8: q must hold every column in 4-byte aligned rows");
  if (padded_rows == 0 || q_stride == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = k % kVec == 0 && x_stride % kVec == 0 && q_stride % kVec == 0 &&
                     reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % kVec == 0;
    const auto launch = [&](auto vec_width) {
      constexpr int V = decltype(vec_width)::value;
      // 256 vectors a block across, and about 16 blocks a multiprocessor's worth of rows down.
      const int64_t across = (q_stride / V + 255) / 256;
      const int64_t down = std::clamp<int64_t>(2048 / across, 1, std::min<int64_t>(padded_rows, 65535));
      quantize_scaled_kernel<T, V><<<dim3(static_cast<unsigned>(across), static_cast<unsigned>(down)), 256, 0, s>>>(
          static_cast<const T*>(x), rows, padded_rows, k, x_stride, static_cast<uint8_t*>(q), q_stride, scale);
    };
    if (vec)
      launch(std::integral_constant<int, kVec>());
    else
      launch(std::integral_constant<int, 1>());
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8 scaled quantize kernel launch: ") + cudaGetErrorString(err));
}

void quantize_tensor_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, float* partial, float* scale, void* stream) {
  if (q_stride < k || q_stride % 4 != 0 || reinterpret_cast<uintptr_t>(q) % 4 != 0 || padded_rows < rows)
    throw std::invalid_argument("quantize_tensor_fp8: q must hold every column in 4-byte aligned rows");
  if (padded_rows == 0) return;
  tensor_scale_fp8(dtype, x, rows, k, x_stride, partial, scale, stream);
  quantize_scaled_fp8(dtype, x, rows, padded_rows, k, x_stride, q, q_stride, scale, stream);
}

void quantize_scaled_transposed_fp8(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                                    int64_t padded_rows, int64_t padded_cols, void* q, int64_t q_stride,
                                    const float* scale, void* stream) {
  check_tiles("quantize_scaled_transposed_fp8", rows, cols, padded_rows, padded_cols, q, q_stride, padded_rows);
  if (padded_rows == 0 || padded_cols == 0) return;
  launch_tiles(dtype, x, rows, cols, x_stride, padded_rows, padded_cols, kTensorTransposed, q, q_stride, nullptr, 1,
               scale, static_cast<cudaStream_t>(stream));
}

void quantize_scaled_both_fp8(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                              int64_t padded_rows, int64_t padded_cols, void* q_t, int64_t q_t_stride, void* q,
                              int64_t q_rows, int64_t q_cols, int64_t q_stride, const float* scale, void* stream) {
  check_tiles("quantize_scaled_both_fp8", rows, cols, padded_rows, padded_cols, q_t, q_t_stride, padded_rows);
  const int vec = dtype == DType::kFloat ? 4 : 8;  // the bytes of a thread's codes of one vector
  if (q_rows < rows || q_rows > padded_rows || q_cols < cols || q_cols > padded_cols || q_cols % vec != 0 ||
      q_stride < q_cols || q_stride % vec != 0 || reinterpret_cast<uintptr_t>(q) % vec != 0)
    throw std::invalid_argument("quantize_scaled_both_fp8: x's codes [" + std::to_string(q_rows) + ", " +
                                std::to_string(q_cols) + "] must hold x within the padded tiles, in whole " +
                                std::to_string(vec) + "-byte vectors of aligned rows");
  if (padded_rows == 0 || padded_cols == 0) return;
  launch_tiles(dtype, x, rows, cols, x_stride, padded_rows, padded_cols, kTensorBoth, q_t, q_t_stride, nullptr, 1,
               scale, static_cast<cudaStream_t>(stream), DirectCodes{static_cast<uint8_t*>(q), q_rows, q_cols, q_stride});
}

void scale_rows(DType dtype, void* y, int64_t rows, int64_t n, int64_t y_stride, const float* scale, const void* bias,
                void* stream) {
  if (rows == 0 || n == 0) return;
  if (y_stride < n) throw std::invalid_argument("scale_rows: the row stride is shorter than a row");
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kVec = 16 / sizeof(T);
    auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool vec = n % kVec == 0 && y_stride % kVec == 0 && aligned(y) && aligned(bias);
    const auto launch = [&](auto vec_width) {
      constexpr int V = decltype(vec_width)::value;
      const int64_t items = rows * (n / V);
      const auto blocks = static_cast<unsigned>(std::min<int64_t>(4096, (items + 255) / 256));
      scale_rows_kernel<T, V><<<blocks, 256, 0, s>>>(static_cast<T*>(y), rows, n, y_stride, scale,
                                                     static_cast<const T*>(bias));
    };
    if (vec)
      launch(std::integral_constant<int, kVec>());
    else
      launch(std::integral_constant<int, 1>());
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("scale_rows kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace tiller::model::cuda
