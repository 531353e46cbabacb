// FP8 (e4m3) quantization of activations per token and group of 128 features (one warp per (row,
// group), four values per lane, the group's largest magnitude by a warp reduction), per token
// (one block per row), and of 128x128 tiles (one block per tile: the FP8 training's weights and
// transposed operands); kernels.h.
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
constexpr int kPerLane = kGroup / 32;
// quantize_tiles_fp8's modes (kernels.h)
constexpr int kTile = 0, kTileTransposed = 1, kColumnsTransposed = 2;

template <class T>
__global__ void quantize_groups_kernel(const T* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                                       uint8_t* q, int64_t q_stride, int64_t groups, float* scale,
                                       int64_t scale_stride) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= padded_rows * groups) return;
  const int64_t r = warp / groups, g = warp % groups;
  const int64_t col = g * kGroup + lane * kPerLane;
  float v[kPerLane];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = r < rows && col + i < k ? to_f(x[r * x_stride + col + i]) : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = fp8_scale(amax);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const __nv_fp8_storage_t b = fp8_code(v[i], s);
    packed |= static_cast<uint32_t>(b) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(q + r * q_stride + col) = packed;
  if (lane == 0) scale[g * scale_stride + r] = s;
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

// One 128x128 tile of x per block of 256 threads, each holding an 8x8 sub-block: rows 8 (t % 16)
// .. + 7 and columns 8 (t / 16) .. + 7 of the tile, read as one 16-byte vector per row where the
// layout allows (kVec = 8 two-byte values; else value by value). The scale is the tile's (kTile,
// kTileTransposed: a block reduction) or each column's (kColumnsTransposed: over the thread's 8
// rows, then the 16 lanes that share the columns). A thread writes its codes from registers: 8
// bytes of an output row each, which the 16 lanes of a half warp make one 128-byte row of the
// transposed output (or 16-byte pieces of 16 rows of the tile's own layout). No shared tile.
template <class T, bool kVecLoads>
__global__ void quantize_tiles_kernel(const T* x, int64_t rows, int64_t cols, int64_t x_stride, int mode, uint8_t* q,
                                      int64_t q_stride, float* scale, int64_t scale_stride) {
  constexpr int kSub = 8;
  __shared__ float warp_amax[8];
  const int t = threadIdx.x, rb = t % 16, cb = t / 16;
  const int64_t tr = blockIdx.y, tc = blockIdx.x;  // the tile's row and column
  const int64_t row0 = tr * kGroup + rb * kSub, col0 = tc * kGroup + cb * kSub;
  float v[kSub][kSub];  // [row][column] of the sub-block
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t row = row0 + i;
    if (kVecLoads && row < rows && col0 + kSub <= cols) {
      const Pack<T, kSub> p = *reinterpret_cast<const Pack<T, kSub>*>(x + row * x_stride + col0);
#pragma unroll
      for (int j = 0; j < kSub; ++j) v[i][j] = to_f(p.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kSub; ++j) v[i][j] = row < rows && col0 + j < cols ? to_f(x[row * x_stride + col0 + j]) : 0.f;
    }
  }
  float s_col[kSub];  // the scale of each of the thread's columns
  if (mode == kColumnsTransposed) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < kSub; ++i) a = fmaxf(a, fabsf(v[i][j]));
#pragma unroll
      for (int off = 1; off < 16; off *= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));  // the 16 row blocks
      s_col[j] = a > 0.f ? a / 448.f : 1.f;  // IEEE division, as ATen's
    }
  } else {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < kSub; ++i)
#pragma unroll
      for (int j = 0; j < kSub; ++j) a = fmaxf(a, fabsf(v[i][j]));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
    if (t % 32 == 0) warp_amax[t / 32] = a;
    __syncthreads();
    a = warp_amax[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) a = fmaxf(a, warp_amax[w]);
    const float s = a > 0.f ? a / 448.f : 1.f;
#pragma unroll
    for (int j = 0; j < kSub; ++j) s_col[j] = s;
  }
  if (mode == kTile) {
    // Row i of the sub-block: 8 codes at q[row0 + i][col0 ..].
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      uint2 packed = make_uint2(0, 0);
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const uint32_t code = __nv_cvt_float_to_fp8(v[i][j] / s_col[j], __NV_SATFINITE, __NV_E4M3);
        if (j < 4) packed.x |= code << (8 * j);
        else packed.y |= code << (8 * (j - 4));
      }
      *reinterpret_cast<uint2*>(q + (row0 + i) * q_stride + col0) = packed;
    }
    if (t == 0) scale[tr * scale_stride + tc] = s_col[0];
    return;
  }
  // Transposed: column j of the sub-block is 8 codes of output row col0 + j, at its columns row0 ...
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    uint2 packed = make_uint2(0, 0);
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      const uint32_t code = __nv_cvt_float_to_fp8(v[i][j] / s_col[j], __NV_SATFINITE, __NV_E4M3);
      if (i < 4) packed.x |= code << (8 * i);
      else packed.y |= code << (8 * (i - 4));
    }
    *reinterpret_cast<uint2*>(q + (col0 + j) * q_stride + row0) = packed;
  }
  if (mode == kTileTransposed && t == 0) scale[tc * scale_stride + tr] = s_col[0];
  if (mode == kColumnsTransposed && rb == 0)
#pragma unroll
    for (int j = 0; j < kSub; ++j) scale[tr * scale_stride + col0 + j] = s_col[j];
}

// Per-tensor scaling, pass 1: each block's largest magnitude over the vectors of kVec values it
// strides through (kVec divides k), into partial[blockIdx.x].
template <class T, int kVec>
__global__ void tensor_amax_kernel(const T* x, int64_t rows, int64_t k, int64_t x_stride, float* partial) {
  using P = Pack<T, kVec>;
  const int64_t per_row = k / kVec, total = rows * per_row;
  float amax = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * kVec;
    const P v = *reinterpret_cast<const P*>(x + r * x_stride + c);
#pragma unroll
    for (int j = 0; j < kVec; ++j) amax = fmaxf(amax, fabsf(to_f(v.v[j])));
  }
  amax = block_max(amax);
  if (threadIdx.x == 0) partial[blockIdx.x] = amax;
}

// Pass 2: the tensor's scale from the `parts` partial maxima (every block reduces them: at most a
// few hundred floats), then the codes of [padded_rows, q_stride] (zeros past rows and k), kVec at a
// time; block 0 writes the scale.
template <class T, int kVec>
__global__ void quantize_tensor_kernel(const T* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                                       uint8_t* q, int64_t q_stride, const float* partial, int parts, float* scale) {
  using P = Pack<T, kVec>;
  float amax = 0.f;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) amax = fmaxf(amax, partial[i]);
  amax = block_max(amax);
  const float s = fp8_scale(amax);
  const int64_t per_row = q_stride / kVec, total = padded_rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * kVec;
    Pack<uint8_t, kVec> out;
    if (r < rows && c < k) {
      const P v = *reinterpret_cast<const P*>(x + r * x_stride + c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.v[j] = fp8_code(to_f(v.v[j]), s);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.v[j] = 0;
    }
    *reinterpret_cast<Pack<uint8_t, kVec>*>(q + r * q_stride + c) = out;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = s;
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
  const int64_t warps = padded_rows * groups;
  if (warps == 0) return;
  const int threads = 256;
  const auto blocks = static_cast<unsigned>((warps * 32 + threads - 1) / threads);
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    quantize_groups_kernel<T><<<blocks, threads, 0, s>>>(static_cast<const T*>(x), rows, padded_rows, k, x_stride,
                                                         static_cast<uint8_t*>(q), q_stride, groups, scale,
                                                         scale_stride);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("fp8 quantize kernel launch: ") + cudaGetErrorString(err));
}

void quantize_tiles_fp8(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                        int64_t padded_rows, int64_t padded_cols, Fp8Tiles mode, void* q, int64_t q_stride,
                        float* scale, int64_t scale_stride, void* stream) {
  const bool transposed = mode != Fp8Tiles::kTile;
  const int64_t out_cols = transposed ? padded_rows : padded_cols;
  const int64_t tiles_r = padded_rows / kGroup, tiles_c = padded_cols / kGroup;
  const int64_t scale_rows = mode == Fp8Tiles::kTile ? tiles_c : mode == Fp8Tiles::kTileTransposed ? tiles_r
                                                                                                   : padded_cols;
  if (padded_rows % kGroup != 0 || padded_cols % kGroup != 0 || padded_rows < rows || padded_cols < cols ||
      q_stride < out_cols || q_stride % 4 != 0 || reinterpret_cast<uintptr_t>(q) % 4 != 0 ||
      scale_stride < scale_rows || tiles_r > 65535 || tiles_c > 2147483647)
    throw std::invalid_argument("quantize_tiles_fp8: the padded extents must be whole tiles that q (4-byte aligned "
                                "rows) and the scales hold");
  if (tiles_r == 0 || tiles_c == 0) return;
  const dim3 grid(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r));
  const auto s = static_cast<cudaStream_t>(stream);
  if (q_stride % 8 != 0 || reinterpret_cast<uintptr_t>(q) % 8 != 0)
    throw std::invalid_argument("quantize_tiles_fp8: q's rows must be 8-byte aligned");
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kSub = 8;
    // One 16-byte load per sub-block row: 8 values of two bytes, rows that start 16-byte aligned.
    const bool vec = sizeof(T) == 2 && cols % kSub == 0 && x_stride % kSub == 0 &&
                     reinterpret_cast<uintptr_t>(x) % 16 == 0;
    if (vec)
      quantize_tiles_kernel<T, true><<<grid, 256, 0, s>>>(static_cast<const T*>(x), rows, cols, x_stride,
                                                          static_cast<int>(mode), static_cast<uint8_t*>(q), q_stride,
                                                          scale, scale_stride);
    else
      quantize_tiles_kernel<T, false><<<grid, 256, 0, s>>>(static_cast<const T*>(x), rows, cols, x_stride,
                                                           static_cast<int>(mode), static_cast<uint8_t*>(q), q_stride,
                                                           scale, scale_stride);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("fp8 tile quantize kernel launch: ") + cudaGetErrorString(err));
}

void quantize_tensor_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, float* partial, float* scale, void* stream) {
  if (q_stride < k || q_stride % 4 != 0 || reinterpret_cast<uintptr_t>(q) % 4 != 0 || padded_rows < rows)
    throw std::invalid_argument("quantize_tensor_fp8: q must hold every column in 4-byte aligned rows");
  if (padded_rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  constexpr int kThreads = 256;
  with_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = k % kVec == 0 && x_stride % kVec == 0 && q_stride % kVec == 0 &&
                     reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % kVec == 0;
    const auto launch = [&](auto vec_width) {
      constexpr int V = decltype(vec_width)::value;
      const int64_t in = std::max<int64_t>(1, rows * (k / V)), out = padded_rows * (q_stride / V);
      const auto parts = static_cast<int>(std::min<int64_t>(kFp8TensorParts, (in + kThreads - 1) / kThreads));
      const auto blocks = static_cast<unsigned>(std::min<int64_t>(1024, (out + kThreads - 1) / kThreads));
      tensor_amax_kernel<T, V><<<parts, kThreads, 0, s>>>(static_cast<const T*>(x), rows, k, x_stride, partial);
      quantize_tensor_kernel<T, V><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), rows, padded_rows, k,
                                                                x_stride, static_cast<uint8_t*>(q), q_stride, partial,
                                                                parts, scale);
    };
    if (vec)
      launch(std::integral_constant<int, kVec>());
    else
      launch(std::integral_constant<int, 1>());
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8 tensor quantize kernel launch: ") + cudaGetErrorString(err));
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
