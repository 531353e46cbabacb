// silu(gate) * up (the fused gate/up projection's output, or separate gate and up) and its
// backward: one read of each input, one write of each output, optionally with the outputs' tensor
// scales for FP8 training; and, for a tensor-scaled FP8 engine, the fused projection's unscaled
// rows in, the product's rows quantized out.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "model/cuda/convert.cuh"
#include "model/cuda/fp8_codes.cuh"
#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// kVec elements per thread (16 bytes) when the rows allow it, else 1. Forward: out = silu(g) u.
// Backward (grad given): dg = grad u silu'(g), du = grad silu(g), written to out and out2. With
// kAmax, each block's largest magnitude of what it wrote into partial[blockIdx.x] (of out2:
// partial2[blockIdx.x]), as tensor_amax_kernel finds it (the rounded values; NaNs passed over).
template <class T, int kVec, bool kBackward, bool kAmax>
__global__ void swiglu_kernel(const T* gate, int64_t g_stride, const T* up, int64_t u_stride, const T* grad, T* out,
                              T* out2, int64_t tokens, int64_t width, float* partial, float* partial2) {
  using P = Pack<T, kVec>;
  const int64_t per_row = width / kVec;
  const int64_t total = tokens * per_row;
  float a = 0.f, a2 = 0.f;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_row, j = (idx % per_row) * kVec;
    const P g = *reinterpret_cast<const P*>(gate + t * g_stride + j);
    const P u = *reinterpret_cast<const P*>(up + t * u_stride + j);
    P o, o2;
    if constexpr (kBackward) {
      const P d = *reinterpret_cast<const P*>(grad + t * width + j);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gv = to_f(g.v[i]), uv = to_f(u.v[i]), dv = to_f(d.v[i]), sg = sigmoid(gv);
        o.v[i] = from_f<T>(dv * uv * (sg * (1.f + gv * (1.f - sg))));
        o2.v[i] = from_f<T>(dv * (gv * sg));
        if constexpr (kAmax) a2 = fmaxf(a2, fabsf(to_f(o2.v[i])));
      }
      *reinterpret_cast<P*>(out2 + t * width + j) = o2;
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gv = to_f(g.v[i]);
        o.v[i] = from_f<T>(gv / (1.f + expf(-gv)) * to_f(u.v[i]));
      }
    }
    if constexpr (kAmax) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) a = fmaxf(a, fabsf(to_f(o.v[i])));
    }
    *reinterpret_cast<P*>(out + t * width + j) = o;
  }
  if constexpr (kAmax) {
    a = block_max(a);
    if (threadIdx.x == 0) partial[blockIdx.x] = a;
    if constexpr (kBackward) {
      a2 = block_max(a2);
      if (threadIdx.x == 0) partial2[blockIdx.x] = a2;
    }
  }
}

// One block per row of the fused gate/up product x (gate then up, each `width` wide), its row
// scaled by x_scale[row] as scale_rows rounds it: g = T(x_g * s), u = T(x_u * s), a = T(silu(g) u)
// as swiglu_kernel computes it; a's row quantized as quantize_rows_fp8 quantizes it (codes into q,
// zeros past width; rows from `rows` on: zeros, scale 1). The row of a waits in shared memory
// (width values) between the two passes. About two vectors a thread, up to 1024 threads: a
// decode batch has few rows, so a row's block is what keeps the SMs busy (measured on H200 at
// 7B's width and 256 rows: 16 us with 512 threads, 20 us with registers holding a, 31 us
// computing a twice, against 31 us for scale_rows, swiglu_packed and quantize_rows_fp8).
template <class T, int kVec>
__global__ void __launch_bounds__(1024, 2) swiglu_fp8_kernel(const T* x, int64_t x_stride, const float* x_scale,
                                                          int64_t rows, int64_t width, uint8_t* q, int64_t q_stride,
                                                          float* scale) {
  using P = Pack<T, kVec>;
  using Codes = Pack<uint8_t, kVec>;
  extern __shared__ __align__(16) unsigned char swiglu_row[];
  P* held = reinterpret_cast<P*>(swiglu_row);
  const int64_t r = blockIdx.x, vecs = width / kVec, qvecs = q_stride / kVec;
  uint8_t* qr = q + r * q_stride;
  if (r >= rows) {
    for (int64_t j = threadIdx.x; j < qvecs; j += blockDim.x) reinterpret_cast<Codes*>(qr)[j] = Codes{};
    if (threadIdx.x == 0) scale[r] = 1.f;
    return;
  }
  const T* gate = x + r * x_stride;
  const T* up = gate + width;
  const float s = x_scale[r];
  float amax = 0.f;
#pragma unroll 2
  for (int64_t j = threadIdx.x; j < vecs; j += blockDim.x) {
    const P g = reinterpret_cast<const P*>(gate)[j];
    const P u = reinterpret_cast<const P*>(up)[j];
    P a;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float gv = to_f(from_f<T>(__fmul_rn(to_f(g.v[i]), s)));
      const float uv = to_f(from_f<T>(__fmul_rn(to_f(u.v[i]), s)));
      a.v[i] = from_f<T>(gv / (1.f + expf(-gv)) * uv);
      amax = fmaxf(amax, fabsf(to_f(a.v[i])));
    }
    held[j] = a;
  }
  const float out_scale = fp8_scale(block_max(amax));  // its barrier also publishes `held`
  for (int64_t j = threadIdx.x; j < qvecs; j += blockDim.x) {
    Codes c{};
    if (j < vecs) {
      const P a = held[j];
#pragma unroll
      for (int i = 0; i < kVec; ++i) c.v[i] = fp8_code(to_f(a.v[i]), out_scale);
    }
    reinterpret_cast<Codes*>(qr)[j] = c;
  }
  if (threadIdx.x == 0) scale[r] = out_scale;
}

// `partial` (kFp8TensorParts floats, twice for the backward), `scale` and `scale2` (the backward's
// second output's): the outputs' tensor scales too, from at most kFp8TensorParts blocks' maxima.
template <class T, bool kBackward>
void launch(const void* gate, int64_t g_stride, const void* up, int64_t u_stride, const void* grad, void* out,
            void* out2, int64_t tokens, int64_t width, cudaStream_t s, float* partial = nullptr,
            float* scale = nullptr, float* scale2 = nullptr) {
  constexpr int kVec = 16 / sizeof(T);
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = width % kVec == 0 && g_stride % kVec == 0 && u_stride % kVec == 0 && aligned(gate) &&
                   aligned(up) && aligned(grad) && aligned(out) && aligned(out2);
  const int64_t items = tokens * (vec ? width / kVec : width);
  const bool amax = partial != nullptr;
  if (amax && (scale == nullptr || (kBackward && scale2 == nullptr)))
    throw std::invalid_argument("swiglu: the outputs' maxima need a scale for each output");
  if (items == 0) {
    if (amax) fp8_scale_of_partials(nullptr, 0, scale, s);  // nothing: scale 1
    if (amax && kBackward) fp8_scale_of_partials(nullptr, 0, scale2, s);
    return;
  }
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(
      std::min<int64_t>((items + threads - 1) / threads, amax ? kFp8TensorParts : int64_t{65535} * 8));
  auto go = [&](auto kernel) {
    kernel<<<blocks, threads, 0, s>>>(static_cast<const T*>(gate), g_stride, static_cast<const T*>(up), u_stride,
                                      static_cast<const T*>(grad), static_cast<T*>(out), static_cast<T*>(out2), tokens,
                                      width, partial, amax ? partial + kFp8TensorParts : nullptr);
  };
  if (amax) {
    if (vec) go(swiglu_kernel<T, kVec, kBackward, true>);
    else go(swiglu_kernel<T, 1, kBackward, true>);
  } else {
    if (vec) go(swiglu_kernel<T, kVec, kBackward, false>);
    else go(swiglu_kernel<T, 1, kBackward, false>);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("swiglu kernel launch: ") + cudaGetErrorString(err));
  if (amax) fp8_scale_of_partials(partial, static_cast<int>(blocks), scale, s);
  if (amax && kBackward) fp8_scale_of_partials(partial + kFp8TensorParts, static_cast<int>(blocks), scale2, s);
}

}  // namespace

void swiglu_packed(DType dtype, const void* x, void* out, int64_t tokens, int64_t width, int64_t x_row_stride,
                   void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    launch<T, false>(x, x_row_stride, static_cast<const T*>(x) + width, x_row_stride, nullptr, out, nullptr, tokens,
                     width, s);
  });
}

void swiglu(DType dtype, const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* out,
            int64_t tokens, int64_t width, void* stream, float* partial, float* scale) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type, false>(gate, gate_stride, up, up_stride, nullptr, out, nullptr, tokens, width, s,
                                              partial, scale);
  });
}

void swiglu_backward(DType dtype, const void* gate, const void* up, const void* grad, void* grad_gate, void* grad_up,
                     int64_t tokens, int64_t width, void* stream, float* partial, float* scale, float* scale_up) {
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    launch<typename decltype(t)::type, true>(gate, width, up, width, grad, grad_gate, grad_up, tokens, width, s,
                                             partial, scale, scale_up);
  });
}

void swiglu_fp8(DType dtype, const void* x, int64_t x_stride, const float* x_scale, int64_t rows, int64_t padded_rows,
                int64_t width, void* q, int64_t q_stride, float* scale, void* stream) {
  if (padded_rows < rows || padded_rows > 2147483647 || q_stride < width || q_stride % 4 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 4 != 0 || x_stride < 2 * width)
    throw std::invalid_argument("swiglu_fp8: q must hold every column of every padded row in 4-byte aligned rows");
  if (padded_rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = width % kVec == 0 && x_stride % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                     q_stride % kVec == 0 && reinterpret_cast<uintptr_t>(q) % kVec == 0;
    const auto grid = static_cast<unsigned>(padded_rows);
    const auto smem = static_cast<size_t>(width) * sizeof(T);
    if (smem > static_cast<size_t>(kSwigluFp8MaxBytes))
      throw std::invalid_argument("swiglu_fp8: a row wider than its shared memory holds");
    const auto go = [&](auto kernel, int64_t vecs) {
      if (smem > 48 * 1024) {  // past the default: the most any row takes, once per device (before a capture)
        static bool done[64] = {};
        reserve_shared_memory(kernel, static_cast<int>(kSwigluFp8MaxBytes), done, "swiglu_fp8");
      }
      const auto threads = static_cast<unsigned>(std::clamp<int64_t>((vecs / 2 + 31) / 32 * 32, 128, 1024));
      kernel<<<grid, threads, smem, s>>>(static_cast<const T*>(x), x_stride, x_scale, rows, width,
                                         static_cast<uint8_t*>(q), q_stride, scale);
    };
    if (vec)
      go(swiglu_fp8_kernel<T, kVec>, width / kVec);
    else
      go(swiglu_fp8_kernel<T, 1>, width);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("swiglu_fp8 kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace tiller::model::cuda
