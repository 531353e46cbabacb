// algo.logprob_match = bitwise on CUDA: matmuls whose rows do not depend on the batch
// (kernels.h). cuBLASLt picks its kernel from the whole problem shape, and a split-K or
// stream-K kernel sums K in pieces whose boundaries follow M; so one algorithm is fixed per
// (device, dtype, K), from the heuristic for a reference shape with split-K excluded, and kept
// only if a probe on this device finds its output rows bitwise independent of M and its columns
// of N. One kernel per K then computes every output element as the same K-ordered sum, for the
// engine's decode batch of 1 and the trainer's 16k packed tokens alike.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "model/cuda/kernels.h"

namespace tiller::model::cuda {
namespace {

constexpr int64_t kRefTokens = 256, kRefOut = 4096;  // the heuristic's reference shape (M, N)
constexpr size_t kMaxWorkspace = size_t{32} << 20;
constexpr int kCandidates = 16;

void ok(cublasStatus_t s, const std::string& what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error("batch-invariant matmul: " + what + " failed (cuBLAS status " +
                             std::to_string(static_cast<int>(s)) + ")");
}
void ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error("batch-invariant matmul: " + what + " failed: " + cudaGetErrorString(e));
}

cudaDataType_t data_type(DType d) {
  return d == DType::kBFloat16 ? CUDA_R_16BF : d == DType::kHalf ? CUDA_R_16F : CUDA_R_32F;
}
size_t element_size(DType d) { return d == DType::kFloat ? 4 : 2; }
const char* name(DType d) { return d == DType::kBFloat16 ? "bf16" : d == DType::kHalf ? "fp16" : "fp32"; }

cublasLtHandle_t handle() {
  static std::once_flag once;
  static cublasLtHandle_t h = nullptr;
  std::call_once(once, [] { ok(cublasLtCreate(&h), "cublasLtCreate"); });
  return h;
}

// The descriptors of y [m, n] = x [m, k] @ w [n, k]^T, in cuBLAS's column-major terms
// y^T [n, m] = (w as [k, n])^T (x as [k, m]).
struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  Problem(DType dt, int64_t m, int64_t n, int64_t k, int64_t x_stride) {
    ok(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t t = CUBLAS_OP_T, n_op = CUBLAS_OP_N;
    ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "setting TRANSA");
    ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n_op, sizeof(n_op)), "setting TRANSB");
    const cudaDataType_t ty = data_type(dt);
    ok(cublasLtMatrixLayoutCreate(&a, ty, static_cast<uint64_t>(k), static_cast<uint64_t>(n), k), "the weight's layout");
    ok(cublasLtMatrixLayoutCreate(&b, ty, static_cast<uint64_t>(k), static_cast<uint64_t>(m), x_stride),
       "the input's layout");
    ok(cublasLtMatrixLayoutCreate(&c, ty, static_cast<uint64_t>(n), static_cast<uint64_t>(m), n), "the output's layout");
  }
  ~Problem() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
};

struct Plan {
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};

cublasStatus_t run(const Plan& p, DType dt, const void* x, int64_t x_stride, const void* w, void* y, int64_t m,
                   int64_t n, int64_t k, void* ws, size_t ws_bytes, cudaStream_t stream) {
  const Problem pr(dt, m, n, k, x_stride);
  const float alpha = 1.f, beta = 0.f;
  return cublasLtMatmul(handle(), pr.op, &alpha, w, pr.a, x, pr.b, &beta, y, pr.c, y, pr.c, &p.algo, ws, ws_bytes,
                        stream);
}

// Device memory for the probe, freed on every path.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (bytes) ok(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes for the probe");
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

std::vector<unsigned char> random_matrix(DType dt, int64_t elems, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<unsigned char> out(static_cast<size_t>(elems) * element_size(dt));
  for (int64_t i = 0; i < elems; ++i) {
    const float v = u(gen);
    if (dt == DType::kFloat) {
      std::memcpy(out.data() + 4 * i, &v, 4);
    } else if (dt == DType::kBFloat16) {
      const __nv_bfloat16 h = __float2bfloat16(v);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      const __half h = __float2half(v);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// Whether `p` computes every row of y as it does alone and every column as it does beside any
// other: a full product [600, 136] against products of fewer rows (1, 3, 64, 257) and fewer
// columns (8). Any failure of the algorithm on these shapes also rejects it.
bool probe(const Plan& p, DType dt, int64_t k, cudaStream_t stream) {
  constexpr int64_t kM = 600, kN = 136;
  const size_t es = element_size(dt);
  const auto xs = random_matrix(dt, kM * k, 1), ws = random_matrix(dt, kN * k, 2);
  DeviceBuffer x(xs.size()), w(ws.size()), full(kM * kN * es), part(kM * kN * es), work(p.workspace);
  ok(cudaMemcpyAsync(x.p, xs.data(), xs.size(), cudaMemcpyHostToDevice, stream), "the probe's upload");
  ok(cudaMemcpyAsync(w.p, ws.data(), ws.size(), cudaMemcpyHostToDevice, stream), "the probe's upload");
  if (run(p, dt, x.p, k, w.p, full.p, kM, kN, k, work.p, p.workspace, stream) != CUBLAS_STATUS_SUCCESS) return false;
  std::vector<unsigned char> want(kM * kN * es), got(kM * kN * es);
  ok(cudaMemcpyAsync(want.data(), full.p, want.size(), cudaMemcpyDeviceToHost, stream), "the probe's download");
  ok(cudaStreamSynchronize(stream), "the probe");
  for (const int64_t m : {1, 3, 64, 257}) {
    if (run(p, dt, x.p, k, w.p, part.p, m, kN, k, work.p, p.workspace, stream) != CUBLAS_STATUS_SUCCESS) return false;
    ok(cudaMemcpyAsync(got.data(), part.p, m * kN * es, cudaMemcpyDeviceToHost, stream), "the probe's download");
    ok(cudaStreamSynchronize(stream), "the probe");
    if (std::memcmp(got.data(), want.data(), m * kN * es) != 0) return false;
  }
  constexpr int64_t kFew = 8;
  if (run(p, dt, x.p, k, w.p, part.p, kM, kFew, k, work.p, p.workspace, stream) != CUBLAS_STATUS_SUCCESS) return false;
  ok(cudaMemcpyAsync(got.data(), part.p, kM * kFew * es, cudaMemcpyDeviceToHost, stream), "the probe's download");
  ok(cudaStreamSynchronize(stream), "the probe");
  for (int64_t r = 0; r < kM; ++r)
    if (std::memcmp(got.data() + r * kFew * es, want.data() + r * kN * es, kFew * es) != 0) return false;
  return true;
}

Plan choose(DType dt, int64_t k, cudaStream_t stream) {
  cublasLtMatmulPreference_t pref = nullptr;
  ok(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  struct Release {
    cublasLtMatmulPreference_t p;
    ~Release() { cublasLtMatmulPreferenceDestroy(p); }
  } release{pref};
  const uint64_t max_ws = kMaxWorkspace;
  const uint32_t no_split = CUBLASLT_REDUCTION_SCHEME_NONE, align = 16;
  ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)),
     "setting the workspace limit");
  ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split, sizeof(no_split)),
     "excluding split-K");
  for (const auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    ok(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)), "setting the alignment");
  const Problem ref(dt, kRefTokens, kRefOut, k, k);
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  ok(cublasLtMatmulAlgoGetHeuristic(handle(), ref.op, ref.a, ref.b, ref.c, ref.c, pref, kCandidates, results, &found),
     "cublasLtMatmulAlgoGetHeuristic for K = " + std::to_string(k));
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    uint32_t splits = 1;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits),
                                             &written) == CUBLAS_STATUS_SUCCESS &&
        splits > 1)
      continue;
    Plan p;
    p.algo = results[i].algo;
    p.workspace = results[i].workspaceSize;
    if (probe(p, dt, k, stream)) return p;
  }
  throw std::runtime_error("batch-invariant matmul: none of the " + std::to_string(found) +
                           " cuBLASLt algorithms offered for K = " + std::to_string(k) + " in " + name(dt) +
                           " keeps each output row independent of the others (algo.logprob_match = bitwise cannot "
                           "run this model on this GPU; set algo.logprob_match: off)");
}

std::mutex g_mu;
std::map<std::tuple<int, int, int64_t>, Plan> g_plans;

const Plan& plan(DType dt, int64_t k, int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto key = std::make_tuple(device, static_cast<int>(dt), k);
  if (auto it = g_plans.find(key); it != g_plans.end()) return it->second;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  ok(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  if (capturing != cudaStreamCaptureStatusNone)
    throw std::runtime_error("batch-invariant matmul: the first product with K = " + std::to_string(k) +
                             " comes inside a CUDA graph capture; run the model once before capturing");
  return g_plans.emplace(key, choose(dt, k, stream)).first->second;
}

}  // namespace

size_t invariant_gemm_workspace(DType dtype, int64_t k, int device, void* stream) {
  return plan(dtype, k, device, static_cast<cudaStream_t>(stream)).workspace;
}

void invariant_gemm(DType dtype, const void* x, int64_t x_stride, const void* w, void* y, int64_t m, int64_t n,
                    int64_t k, void* workspace, size_t workspace_bytes, int device, void* stream) {
  if (m == 0 || n == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const Plan& p = plan(dtype, k, device, s);
  if (workspace_bytes < p.workspace)
    throw std::invalid_argument("batch-invariant matmul: a workspace of " + std::to_string(workspace_bytes) +
                                " bytes, the algorithm needs " + std::to_string(p.workspace));
  ok(run(p, dtype, x, x_stride, w, y, m, n, k, workspace, workspace_bytes, s),
     "cublasLtMatmul [" + std::to_string(m) + ", " + std::to_string(k) + "] x [" + std::to_string(n) + ", " +
         std::to_string(k) + "]^T");
}

}  // namespace tiller::model::cuda
