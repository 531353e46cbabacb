// Element conversions and vector packs shared by the model's CUDA kernels: fp32 math on
// bf16/fp16/fp32 storage; and a kernel's opt-in to more than 48 KiB of shared memory.
// CUDA translation units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "model/cuda/kernels.h"

namespace tiller::model::cuda {

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }

template <class T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_f(float v) { return __float2half(v); }
template <>
__device__ __forceinline__ float from_f(float v) { return v; }

// Host side: calls f(Type<T>{}) with T the storage type of `dtype` (what each kernel file's
// launcher instantiates), and returns what f returns.
template <class T>
struct Type {
  using type = T;
};
template <class F>
decltype(auto) with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: return f(Type<__nv_bfloat16>{});
    case DType::kHalf: return f(Type<__half>{});
    case DType::kFloat: return f(Type<float>{});
  }
  throw std::invalid_argument("unknown kernel dtype");
}

// Rotary embedding of one pair (x1 at i, x2 at i + dim/2) with the tables' cos and sin at i (c1,
// s1) and at i + dim/2 (c2, s2): o1 = x1 c1 - x2 s1, o2 = x2 c2 + x1 s2. One definition for every
// kernel that rotates (rope.cu, the engine's decode attention), so that they round alike.
__device__ __forceinline__ void rope_pair(float x1, float x2, float c1, float s1, float c2, float s2, float& o1,
                                          float& o2) {
  o1 = x1 * c1 - x2 * s1;
  o2 = x2 * c2 + x1 * s2;
}

// kVec elements of T moved as one aligned vector (16 bytes at kVec = 16 / sizeof(T)).
template <class T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Opts `kernel` in to `bytes` of dynamic shared memory (above the default 48 KiB), once per
// device (`done`: the kernel's flags by device).
template <class Kernel>
void reserve_shared_memory(Kernel kernel, int bytes, bool (&done)[64], const char* what) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": cudaGetDevice failed: " + cudaGetErrorString(err));
  if (device >= 0 && device < 64 && done[device]) return;
  if (const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": cannot reserve " + std::to_string(bytes) +
                             " bytes of shared memory: " + cudaGetErrorString(err));
  if (device >= 0 && device < 64) done[device] = true;
}

}  // namespace tiller::model::cuda
