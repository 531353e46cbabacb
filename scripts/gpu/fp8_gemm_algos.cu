// Every algorithm cuBLASLt offers for tensor-scaled FP8 GEMMs (e4m3 x e4m3 -> bf16, fp32
// accumulation, with and without fast accumulation) at the shapes tiller runs: the 7B engine's
// four projections at decode batches 64 and 256 (fused q/k/v and gate/up, as the engine keeps
// them) and the 7B training step's forward, dgrad and wgrad of the seven projections at 8,192
// tokens. For each shape: the heuristic's first choice (what torch's _scaled_mm runs) and the
// fastest of up to 32 candidates, in microseconds per call (CUDA graph of 20 calls), with the
// candidate's tile, stages and split-K. Decides whether tiller should pick its FP8 GEMM
// algorithms by measuring them instead of taking the heuristic's first.
//   nvcc -std=c++17 -O2 -arch=sm_90 -o algos scripts/gpu/fp8_gemm_algos.cu -lcublasLt && ./algos
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e = (x);                                                                      \
    if (e != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define LT(x)                                                                     \
  do {                                                                            \
    cublasStatus_t status_ = (x);                                                       \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                                             \
      std::fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)status_); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

struct Shape {
  const char* name;
  long rows, cols, inner;  // out [rows, cols] = a [rows, inner] . b [cols, inner]^T
};

__global__ void fill(unsigned char* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned z = (unsigned)(i * 2654435761u) ^ seed;
    z ^= z >> 13;
    z *= 0x5bd1e995u;
    p[i] = (unsigned char)((z >> 8) & 0x77);  // finite e4m3 codes of either sign, |v| < 2
  }
}

int main() {
  const long T = 8192;
  std::vector<Shape> shapes = {
      {"decode256.qkv", 256, 4608, 3584},   {"decode256.o", 256, 3584, 3584},
      {"decode256.gate_up", 256, 37888, 3584}, {"decode256.down", 256, 3584, 18944},
      {"decode64.qkv", 64, 4608, 3584},     {"decode64.o", 64, 3584, 3584},
      {"decode64.gate_up", 64, 37888, 3584}, {"decode64.down", 64, 3584, 18944},
  };
  // training: forward x[T,K].w[N,K]^T, dgrad gy[T,N].(w^T)[K,N]^T, wgrad gy^T[N,T].(x^T)[K,T]^T
  const long qkvo[7][2] = {{3584, 3584}, {512, 3584}, {512, 3584}, {3584, 3584},
                           {18944, 3584}, {18944, 3584}, {3584, 18944}};
  const char* names[7] = {"q", "k", "v", "o", "gate", "up", "down"};
  std::vector<std::string> keep;
  keep.reserve(32);
  for (int i = 0; i < 7; ++i) {
    long n = qkvo[i][0], k = qkvo[i][1];
    keep.push_back(std::string("train.fwd.") + names[i]);
    shapes.push_back({keep.back().c_str(), T, n, k});
    keep.push_back(std::string("train.dgrad.") + names[i]);
    shapes.push_back({keep.back().c_str(), T, k, n});
    keep.push_back(std::string("train.wgrad.") + names[i]);
    shapes.push_back({keep.back().c_str(), n, k, T});
  }

  cublasLtHandle_t lt;
  LT(cublasLtCreate(&lt));
  size_t max_bytes = 0;
  for (auto& s : shapes) {
    max_bytes = std::max(max_bytes, (size_t)s.rows * s.inner);
    max_bytes = std::max(max_bytes, (size_t)s.cols * s.inner);
  }
  unsigned char *a, *b;
  __nv_bfloat16* d;
  float* scale;
  CHECK(cudaMalloc(&a, max_bytes));
  CHECK(cudaMalloc(&b, max_bytes));
  CHECK(cudaMalloc(&d, (size_t)T * 18944 * 2));
  CHECK(cudaMalloc(&scale, 16));
  float ones[4] = {1, 1, 1, 1};
  CHECK(cudaMemcpy(scale, ones, sizeof ones, cudaMemcpyHostToDevice));
  fill<<<1024, 256>>>(a, max_bytes, 1);
  fill<<<1024, 256>>>(b, max_bytes, 2);
  const size_t ws_bytes = 64ull << 20;
  void* ws;
  CHECK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  for (auto& s : shapes) {
    for (int fast = 0; fast < 2; ++fast) {
      cublasLtMatmulDesc_t op;
      LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
      const void* sp = scale;
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sp, sizeof sp));
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sp, sizeof sp));
      const int8_t f = (int8_t)fast;
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof f));
      // column-major: out^T [cols, rows] = (b as [inner, cols])^T . (a as [inner, rows])
      cublasLtMatrixLayout_t la, lb, lc;
      LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, s.inner, s.cols, s.inner));
      LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, s.inner, s.rows, s.inner));
      LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, s.cols, s.rows, s.cols));
      cublasLtMatmulPreference_t pref;
      LT(cublasLtMatmulPreferenceCreate(&pref));
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                              sizeof ws_bytes));
      cublasLtMatmulHeuristicResult_t res[32];
      int got = 0;
      LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 32, res, &got));
      const float alpha = 1.f, beta = 0.f;
      double first = -1, best = 1e30;
      int best_i = -1;
      for (int i = 0; i < got; ++i) {
        auto call = [&] {
          return cublasLtMatmul(lt, op, &alpha, b, la, a, lb, &beta, d, lc, d, lc, &res[i].algo, ws, ws_bytes, st);
        };
        if (call() != CUBLAS_STATUS_SUCCESS) continue;
        CHECK(cudaStreamSynchronize(st));
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        bool fine = true;
        for (int r = 0; r < 20; ++r) fine = fine && call() == CUBLAS_STATUS_SUCCESS;
        CHECK(cudaStreamEndCapture(st, &g));
        if (!fine) {
          cudaGraphDestroy(g);
          continue;
        }
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        CHECK(cudaGraphLaunch(ge, st));
        CHECK(cudaEventRecord(e0, st));
        for (int r = 0; r < 5; ++r) CHECK(cudaGraphLaunch(ge, st));
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        const double us = ms * 1000.0 / 100;
        CHECK(cudaGraphExecDestroy(ge));
        CHECK(cudaGraphDestroy(g));
        if (i == 0) first = us;
        if (us < best) best = us, best_i = i;
      }
      int tile = -1, stages = -1, splitk = -1, id = -1;
      if (best_i >= 0) {
        size_t w;
        cublasLtMatmulAlgoConfigGetAttribute(&res[best_i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&res[best_i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&res[best_i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages,
                                             &w);
        cublasLtMatmulAlgoConfigGetAttribute(&res[best_i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                             sizeof splitk, &w);
      }
      const double tflops = 2.0 * s.rows * s.cols * s.inner / (best * 1e-6) / 1e12;
      std::printf(
          "{\"shape\": \"%s\", \"rows\": %ld, \"cols\": %ld, \"inner\": %ld, \"fast_accum\": %d, \"candidates\": %d, "
          "\"first_us\": %.2f, \"best_us\": %.2f, \"best_index\": %d, \"gain\": %.3f, \"best_tflops\": %.0f, "
          "\"algo\": %d, \"tile\": %d, \"stages\": %d, \"splitk\": %d}\n",
          s.name, s.rows, s.cols, s.inner, fast, got, first, best, best_i, first / best, tflops, id, tile, stages,
          splitk);
      std::fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(op);
    }
  }
  return 0;
}
