// FP8 training's quantization kernels alone (src/model/cuda/fp8.cu: quantize_groups_fp8,
// quantize_tiles_fp8, and tensor scaling's tensor_scale_fp8 with quantize_scaled_fp8 or
// quantize_scaled_transposed_fp8) at the 7B step's shapes: microseconds and GB/s a launch, and a
// hash of every output, so that two builds of fp8.cu (e.g. HEAD's and the working tree's) can be
// compared bit for bit; and Fp8Divider (fp8_codes.cuh) against the division over every pair of
// bf16 values, with one correction and with two; and quantize_scaled_both_fp8 against the two
// kernels it stands for, byte for byte. The tensor cases need a build that has them (from
// 2026-11-29; the "both" ones from the sixteenth session's).
//   nvcc -std=c++17 -O2 -arch=sm_90 -I src -o probe scripts/gpu/fp8_quantize_probe.cu src/model/cuda/fp8.cu
//   ./probe            # one line per case: name, us, GB/s, hash
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "model/cuda/convert.cuh"
#include "model/cuda/fp8_codes.cuh"
#include "model/cuda/kernels.h"

using namespace tiller::model::cuda;

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e = (x);                                                                   \
    if (e != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

__device__ uint32_t mix(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// Values of magnitudes that vary by row and column block (2^-12 .. 2^12), with exact zeros,
// negative zeros, and fp32-subnormal values in some places.
template <class T>
__global__ void fill(T* x, int64_t rows, int64_t cols, int64_t stride, uint32_t seed) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * stride) return;
  const int64_t r = i / stride, c = i % stride;
  const uint32_t h = mix(static_cast<uint64_t>(i), seed);
  float u = (static_cast<float>(h & 0xFFFFFF) / 16777216.f) * 2.f - 1.f;
  const int e = static_cast<int>((r / 7 * 5 + c / 96 * 3) % 25) - 12;
  float v = ldexpf(u, e);
  if (h >> 28 == 0) v = 0.f;
  if (h >> 28 == 1) v = -0.f;
  if (sizeof(T) != 2 && r % 97 == 5) v = ldexpf(u, -130);
  if (c >= cols) v = 1e30f;  // past the columns: must never be read
  x[i] = from_f<T>(v);
}

uint64_t fnv(const std::vector<uint8_t>& b, uint64_t h = 1469598103934665603ull) {
  for (uint8_t c : b) h = (h ^ c) * 1099511628211ull;
  return h;
}

template <class T>
struct Dt;
template <>
struct Dt<__nv_bfloat16> {
  static constexpr DType v = DType::kBFloat16;
  static constexpr const char* name = "bf16";
};
template <>
struct Dt<__half> {
  static constexpr DType v = DType::kHalf;
  static constexpr const char* name = "fp16";
};
template <>
struct Dt<float> {
  static constexpr DType v = DType::kFloat;
  static constexpr const char* name = "fp32";
};

int64_t up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// x [rows, stride] on the device, filled (fill) for `seed`.
template <class T>
T* filled(int64_t rows, int64_t cols, int64_t stride, uint32_t seed) {
  T* x;
  CHECK(cudaMalloc(&x, rows * stride * sizeof(T)));
  fill<T><<<(rows * stride + 255) / 256, 256>>>(x, rows, cols, stride, seed);
  CHECK(cudaGetLastError());
  return x;
}

// Runs `launch` once and hashes its codes q and scales s (device buffers of the given sizes), then
// times `reps` more launches and prints one line: name, shape, microseconds, GB/s over `bytes`.
template <class T, class F>
void measure(const char* what, int64_t rows, int64_t cols, F&& launch, int reps, const uint8_t* q, size_t q_bytes,
             const float* s, size_t s_bytes, double bytes) {
  launch();
  CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> hq(q_bytes), hs(s_bytes);
  CHECK(cudaMemcpy(hq.data(), q, hq.size(), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hs.data(), s, hs.size(), cudaMemcpyDeviceToHost));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) launch();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  const double us = ms * 1e3 / reps;
  std::printf("%-34s %-4s %6lld x %6lld  %9.1f us  %7.0f GB/s  q %016llx s %016llx\n", what, Dt<T>::name,
              static_cast<long long>(rows), static_cast<long long>(cols), us, bytes / us / 1e3,
              static_cast<unsigned long long>(fnv(hq)), static_cast<unsigned long long>(fnv(hs)));
}

// mode -1: groups; else the tiles mode.
template <class T>
void run(const char* what, int mode, int64_t rows, int64_t cols, int64_t stride, int reps) {
  T* const x = filled<T>(rows, cols, stride, 7u + static_cast<uint32_t>(rows ^ cols));
  int64_t q_rows, q_cols, s_count, s_stride;
  int64_t pr, pc;
  if (mode < 0) {
    pr = up(rows, 16);
    pc = up(cols, 512);
    q_rows = pr, q_cols = pc, s_stride = pr, s_count = (pc / 128) * pr;
  } else {
    pr = up(rows, 128), pc = up(cols, 512);
    const bool tr = mode != 0;
    q_rows = tr ? pc : pr, q_cols = tr ? pr : pc;
    s_stride = mode == 0 ? pc / 128 : mode == 1 ? pr / 128 : pc;
    s_count = mode == 2 ? (pr / 128) * pc : (pr / 128) * (pc / 128);
  }
  uint8_t* q;
  float* s;
  CHECK(cudaMalloc(&q, q_rows * q_cols));
  CHECK(cudaMalloc(&s, s_count * sizeof(float)));
  CHECK(cudaMemset(q, 0xAB, q_rows * q_cols));
  CHECK(cudaMemset(s, 0xAB, s_count * sizeof(float)));
  auto launch = [&] {
    if (mode < 0)
      quantize_groups_fp8(Dt<T>::v, x, rows, pr, cols, stride, q, q_cols, pc / 128, s, s_stride, nullptr);
    else
      quantize_tiles_fp8(Dt<T>::v, x, rows, cols, stride, pr, pc, static_cast<Fp8Tiles>(mode), q, q_cols, s,
                         s_stride, nullptr);
  };
  const double bytes = static_cast<double>(rows) * cols * sizeof(T) + static_cast<double>(q_rows) * q_cols +
                       static_cast<double>(s_count) * 4;
  measure<T>(what, rows, cols, launch, reps, q, q_rows * q_cols, s, s_count * sizeof(float), bytes);
  CHECK(cudaFree(x));
  CHECK(cudaFree(q));
  CHECK(cudaFree(s));
}

// Tensor scaling (roles.<r>.fp8_scaling: tensor): the tensor's scale (tensor_scale_fp8) and its
// codes for that scale, x's own layout (quantize_scaled_fp8) or x^T by tiles
// (quantize_scaled_transposed_fp8); timed together, as train_linear runs them.
template <class T>
void run_tensor(const char* what, bool transposed, int64_t rows, int64_t cols, int64_t stride, int reps) {
  T* const x = filled<T>(rows, cols, stride, 11u + static_cast<uint32_t>(rows ^ cols));
  const int64_t pr = transposed ? up(rows, 128) : up(rows, 16), pc = transposed ? up(cols, 128) : up(cols, 16);
  const int64_t q_rows = transposed ? pc : pr, q_cols = transposed ? pr : pc;
  uint8_t* q;
  float *s, *partial;
  CHECK(cudaMalloc(&q, q_rows * q_cols));
  CHECK(cudaMalloc(&s, sizeof(float)));
  CHECK(cudaMalloc(&partial, kFp8TensorParts * sizeof(float)));
  CHECK(cudaMemset(q, 0xAB, q_rows * q_cols));
  auto launch = [&] {
    tensor_scale_fp8(Dt<T>::v, x, rows, cols, stride, partial, s, nullptr);
    if (transposed)
      quantize_scaled_transposed_fp8(Dt<T>::v, x, rows, cols, stride, pr, pc, q, q_cols, s, nullptr);
    else
      quantize_scaled_fp8(Dt<T>::v, x, rows, pr, cols, stride, q, q_cols, s, nullptr);
  };
  // x read twice (its maximum, then its codes), the codes written once.
  const double bytes = 2.0 * rows * cols * sizeof(T) + static_cast<double>(q_rows) * q_cols;
  measure<T>(what, rows, cols, launch, reps, q, q_rows * q_cols, s, sizeof(float), bytes);
  CHECK(cudaFree(x));
  CHECK(cudaFree(q));
  CHECK(cudaFree(s));
  CHECK(cudaFree(partial));
}

// Both layouts from one read (quantize_scaled_both_fp8: the training's gy and x with tensor
// scaling) against the two kernels it replaces, for a scale found first: the codes compared byte for
// byte, each way timed (x read once against twice).
template <class T>
void run_both(const char* what, int64_t rows, int64_t cols, int64_t stride, int64_t q_cols, int reps) {
  T* const x = filled<T>(rows, cols, stride, 13u + static_cast<uint32_t>(rows ^ cols));
  const int64_t pr = up(rows, 128), pc = up(cols, 128), q_rows = up(rows, 16);
  uint8_t *qt[2], *q[2];
  float *s, *partial;
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaMalloc(&qt[i], pc * pr));
    CHECK(cudaMalloc(&q[i], q_rows * q_cols));
    CHECK(cudaMemset(qt[i], 0xAB - i, pc * pr));
    CHECK(cudaMemset(q[i], 0xCD - i, q_rows * q_cols));
  }
  CHECK(cudaMalloc(&s, sizeof(float)));
  CHECK(cudaMalloc(&partial, kFp8TensorParts * sizeof(float)));
  tensor_scale_fp8(Dt<T>::v, x, rows, cols, stride, partial, s, nullptr);
  auto separate = [&] {
    quantize_scaled_transposed_fp8(Dt<T>::v, x, rows, cols, stride, pr, pc, qt[0], pr, s, nullptr);
    quantize_scaled_fp8(Dt<T>::v, x, rows, q_rows, cols, stride, q[0], q_cols, s, nullptr);
  };
  auto both = [&] {
    quantize_scaled_both_fp8(Dt<T>::v, x, rows, cols, stride, pr, pc, qt[1], pr, q[1], q_rows, q_cols, q_cols, s,
                             nullptr);
  };
  separate();
  both();
  CHECK(cudaDeviceSynchronize());
  bool same = true;
  for (const auto& [bufs, n] : {std::pair{qt, pc * pr}, std::pair{q, q_rows * q_cols}}) {
    std::vector<uint8_t> a(n), b(n);
    CHECK(cudaMemcpy(a.data(), bufs[0], n, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b.data(), bufs[1], n, cudaMemcpyDeviceToHost));
    same = same && a == b;
  }
  float ms[2] = {0, 0};
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int way = 0; way < 2; ++way) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) way == 0 ? separate() : both();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaEventElapsedTime(&ms[way], a, b));
  }
  const double codes = static_cast<double>(pc) * pr + static_cast<double>(q_rows) * q_cols;
  const double in = static_cast<double>(rows) * cols * sizeof(T);
  std::printf("both %-29s %-4s %6lld x %6lld  separate %8.1f us (%5.0f GB/s)  both %8.1f us (%5.0f GB/s)  %s\n", what,
              Dt<T>::name, static_cast<long long>(rows), static_cast<long long>(cols), ms[0] * 1e3 / reps,
              (2 * in + codes) / (ms[0] * 1e3 / reps) / 1e3, ms[1] * 1e3 / reps,
              (in + codes) / (ms[1] * 1e3 / reps) / 1e3, same ? "codes equal" : "CODES DIFFER");
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaFree(qt[i]));
    CHECK(cudaFree(q[i]));
  }
  CHECK(cudaFree(x));
  CHECK(cudaFree(s));
  CHECK(cudaFree(partial));
}

// Every bf16 v against every finite positive bf16 amax >= |v|: Fp8Divider's code against the
// division's, and the quotients themselves where fp8_quotient.h says they are equal.
__global__ void divider_check(unsigned long long* code_diff, unsigned long long* quot_diff,
                              unsigned long long* pairs) {
  const uint32_t a = blockIdx.x + 1;  // amax bits 1 .. 0x7f7f
  const float amax = __uint_as_float(a << 16);
  const float s = fp8_scale(amax);
  const Fp8Divider d(s);
  unsigned long long cd = 0, qd = 0, n = 0;
  for (uint32_t vb = threadIdx.x; vb < 0x10000; vb += blockDim.x) {
    const float v = __uint_as_float(vb << 16);
    if (!(fabsf(v) <= amax)) continue;
    ++n;
    const float exact = v / s;
    const uint8_t want = __nv_cvt_float_to_fp8(exact, __NV_SATFINITE, __NV_E4M3);
    if (d.code<1>(v) != want || d.code<2>(v) != want || (d.code2<1>(v, -v) & 0xFF) != want) ++cd;
    if (d.reciprocal && fabsf(v) >= 0x1p-100f && fabsf(exact) >= 0x1p-100f &&
        (__float_as_uint(tiller::model::fp8::quotient_by_reciprocal<1>(v, s, d.r)) != __float_as_uint(exact) ||
         __float_as_uint(tiller::model::fp8::quotient_by_reciprocal<2>(v, s, d.r)) != __float_as_uint(exact)))
      ++qd;
  }
  atomicAdd(code_diff, cd);
  atomicAdd(quot_diff, qd);
  atomicAdd(pairs, n);
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  unsigned long long* c;
  CHECK(cudaMalloc(&c, 3 * sizeof(unsigned long long)));
  CHECK(cudaMemset(c, 0, 3 * sizeof(unsigned long long)));
  divider_check<<<0x7f7f, 256>>>(c, c + 1, c + 2);
  CHECK(cudaGetLastError());
  unsigned long long h[3];
  CHECK(cudaMemcpy(h, c, sizeof(h), cudaMemcpyDeviceToHost));
  std::printf("divider: %llu bf16 pairs, codes differ %llu, quotients in range differ %llu\n", h[2], h[0], h[1]);
  // The 7B step's shapes (8,192 tokens a GPU): activations and gradients by groups, their
  // transposes by columns, the weights by tiles and transposed tiles.
  run<__nv_bfloat16>("groups  x/gy [M, 18944]", -1, 8192, 18944, 18944, reps);
  run<__nv_bfloat16>("groups  x/gy [M, 3584]", -1, 8192, 3584, 3584, reps);
  run<__nv_bfloat16>("columns^T x/gy [M, 18944]", 2, 8192, 18944, 18944, reps);
  run<__nv_bfloat16>("columns^T x/gy [M, 3584]", 2, 8192, 3584, 3584, reps);
  run<__nv_bfloat16>("columns^T gy [M, 512]", 2, 8192, 512, 512, reps);
  run<__nv_bfloat16>("tiles   w [18944, 3584]", 0, 18944, 3584, 3584, reps);
  run<__nv_bfloat16>("tiles^T w [18944, 3584]", 1, 18944, 3584, 3584, reps);
  run<__nv_bfloat16>("tiles   w [3584, 18944]", 0, 3584, 18944, 18944, reps);
  run<__nv_bfloat16>("tiles^T w [3584, 18944]", 1, 3584, 18944, 18944, reps);
  // Edges, every dtype: ragged extents, a row stride past the columns, unaligned widths.
  for (int mode = -1; mode < 3; ++mode) {
    const char* names[] = {"groups", "tiles", "tiles^T", "columns^T"};
    run<__nv_bfloat16>(names[mode + 1], mode, 1000, 1000, 1000, 3);
    run<__nv_bfloat16>(names[mode + 1], mode, 999, 1001, 1003, 3);
    run<__nv_bfloat16>(names[mode + 1], mode, 300, 136, 144, 3);
    run<__half>(names[mode + 1], mode, 1000, 1000, 1000, 3);
    run<__half>(names[mode + 1], mode, 999, 1001, 1003, 3);
    run<float>(names[mode + 1], mode, 1000, 1000, 1000, 3);
    run<float>(names[mode + 1], mode, 999, 1001, 1003, 3);
    run<float>(names[mode + 1], mode, 257, 260, 264, 3);
  }
  // Tensor scaling: the 7B shapes, then the edges.
  run_tensor<__nv_bfloat16>("tensor  x/gy [M, 18944]", false, 8192, 18944, 18944, reps);
  run_tensor<__nv_bfloat16>("tensor^T x/gy [M, 18944]", true, 8192, 18944, 18944, reps);
  run_tensor<__nv_bfloat16>("tensor  x/gy [M, 3584]", false, 8192, 3584, 3584, reps);
  run_tensor<__nv_bfloat16>("tensor^T x/gy [M, 3584]", true, 8192, 3584, 3584, reps);
  run_tensor<__nv_bfloat16>("tensor  w [18944, 3584]", false, 18944, 3584, 3584, reps);
  run_tensor<__nv_bfloat16>("tensor^T w [18944, 3584]", true, 18944, 3584, 3584, reps);
  for (const bool tr : {false, true}) {
    const char* name = tr ? "tensor^T" : "tensor";
    run_tensor<__nv_bfloat16>(name, tr, 999, 1001, 1003, 3);
    run_tensor<__nv_bfloat16>(name, tr, 300, 136, 144, 3);
    run_tensor<__half>(name, tr, 999, 1001, 1003, 3);
    run_tensor<float>(name, tr, 1000, 1000, 1000, 3);
    run_tensor<float>(name, tr, 257, 260, 264, 3);
  }
  // Both layouts at once: gy of the MLP's and the attention's products (x's codes 16-column
  // padded, gy's to whole tiles), then the edges.
  run_both<__nv_bfloat16>("gy [M, 37888]", 8192, 37888, 37888, 37888, reps);
  run_both<__nv_bfloat16>("x [M, 3584]", 8192, 3584, 3584, 3584, reps);
  run_both<__nv_bfloat16>("x [M, 18944]", 8192, 18944, 18944, 18944, reps);
  run_both<__nv_bfloat16>("gy [M, 512]", 8192, 512, 512, 512, reps);
  run_both<__nv_bfloat16>("ragged", 999, 1001, 1003, 1008, 3);
  run_both<__nv_bfloat16>("ragged, tiles", 999, 1001, 1003, 1024, 3);
  run_both<__nv_bfloat16>("aligned", 300, 136, 144, 144, 3);
  run_both<__half>("ragged", 999, 1001, 1003, 1008, 3);
  run_both<float>("ragged", 257, 260, 264, 272, 3);
  run_both<float>("whole", 1000, 1000, 1000, 1024, 3);
  return 0;
}
