// The fused SwiGLU + FP8 quantization kernel of tensor scaling (swiglu_fp8, src/model/cuda/swiglu.cu)
// against the unfused kernels it replaces (scale_rows, swiglu_packed, quantize_rows_fp8; the
// "unfused" row includes the copy that keeps its in-place input fresh: see "copy alone") and a
// plain swiglu_packed, at the Qwen2.5 shapes' intermediate widths (and 29,568, past 48 KiB of
// shared memory) and decode's row counts, 50 launches each. Not part of the build; on the GPU host:
//   nvcc -std=c++17 -arch=sm_90 -O3 -I src scripts/gpu/swiglu_fp8_probe.cu -o /tmp/probe && /tmp/probe
// Results: docs/bench/swiglu-fp8-probe-h200-2026-11-29.txt, docs/benchmarks.md.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "model/cuda/fp8.cu"
#include "model/cuda/swiglu.cu"

using namespace tiller::model::cuda;

static void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

int main() {
  for (int64_t width : {18944, 8960, 4864, 29568})
    for (int64_t rows : {64, 256}) {
      const int64_t qs = (width + 15) / 16 * 16;
      __nv_bfloat16 *x, *g, *act;
      float *sc, *so;
      uint8_t* q;
      ok(cudaMalloc(&x, rows * 2 * width * 2), "cudaMalloc");
      ok(cudaMalloc(&g, rows * 2 * width * 2), "cudaMalloc");
      ok(cudaMalloc(&act, rows * width * 2), "cudaMalloc");
      ok(cudaMalloc(&sc, rows * 4), "cudaMalloc");
      ok(cudaMalloc(&so, rows * 4), "cudaMalloc");
      ok(cudaMalloc(&q, rows * qs), "cudaMalloc");
      std::vector<__nv_bfloat16> hx(rows * 2 * width);
      for (size_t i = 0; i < hx.size(); ++i) hx[i] = __float2bfloat16(((i * 2654435761u) % 1000) / 50.f - 10.f);
      ok(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
      std::vector<float> hs(rows, 0.05f);
      ok(cudaMemcpy(sc, hs.data(), rows * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      cudaEvent_t a, b;
      ok(cudaEventCreate(&a), "cudaEventCreate");
      ok(cudaEventCreate(&b), "cudaEventCreate");
      auto time = [&](const char* name, auto f) {
        for (int i = 0; i < 5; ++i) f();
        cudaEventRecord(a);
        for (int i = 0; i < 50; ++i) f();
        cudaEventRecord(b);
        ok(cudaEventSynchronize(b), "cudaEventSynchronize");
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        printf("width %6ld rows %4ld %-28s %7.2f us  %s\n", (long)width, (long)rows, name, ms * 1000 / 50,
               cudaGetErrorString(cudaGetLastError()));
      };
      time("unfused (scale,swiglu,quant)", [&] {
        cudaMemcpyAsync(g, x, rows * 2 * width * 2, cudaMemcpyDeviceToDevice);
        scale_rows(DType::kBFloat16, g, rows, 2 * width, 2 * width, sc, nullptr, nullptr);
        swiglu_packed(DType::kBFloat16, g, act, rows, width, 2 * width, nullptr);
        quantize_rows_fp8(DType::kBFloat16, act, rows, rows, width, width, q, qs, so, nullptr);
      });
      time("copy alone", [&] { cudaMemcpyAsync(g, x, rows * 2 * width * 2, cudaMemcpyDeviceToDevice); });
      time("swiglu_packed alone", [&] { swiglu_packed(DType::kBFloat16, x, act, rows, width, 2 * width, nullptr); });
      time("fused (launcher)", [&] { swiglu_fp8(DType::kBFloat16, x, 2 * width, sc, rows, rows, width, q, qs, so, nullptr); });
      cudaFree(x); cudaFree(g); cudaFree(act); cudaFree(sc); cudaFree(so); cudaFree(q);
    }
}
