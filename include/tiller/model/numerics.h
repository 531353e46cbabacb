// Which forward kernels the model functions of this process use.
//
// kDefault: the fastest kernels at hand (ATen's matmuls, attention backends, fused CUDA ops);
// a token's result may change in its last bits with what else shares the batch (the number of
// rows picks a different GEMM, a longer key range a different reduction split).
//
// kBatchInvariant (`algo.logprob_match: bitwise`): every forward kernel of transformer.h,
// attention.h, the log-prob head (token_logprobs) and the sampler's reported log-prob computes
// each row from that row's inputs alone, reducing in one fixed order that depends only on the
// reduction's length: matmuls never split K and sum each output in the same lane order whatever
// the number of rows; attention sums a query's keys in key order, so a decode step over the
// cache, a chunk of a prefill and the trainer's packed forward give the same bits; RMSNorm,
// RoPE (and its tables), SwiGLU and the log-softmax are one kernel each, used by the engine and
// the trainer alike. Then a token sampled by the engine has, bit for bit, the log-prob the
// trainer computes for it with the same weights. Backward passes still use the ordinary kernels
// (the gradient need not be invariant). CPU tensors, and in the GPU build CUDA tensors of bf16,
// fp16 and fp32 (src/model/batch_invariant.h says how; the CUDA order is not the CPU's, so an
// engine and a trainer compare bitwise on the same kind of device).
//
// The setting is process-wide (like torch.use_deterministic_algorithms): every rank of a job sets
// it once, before its first forward, from the job's config (tiller train does). Reads are
// lock-free; changing it while another thread runs a forward gives that forward mixed kernels.
#pragma once

namespace tiller::model {

enum class Numerics { kDefault, kBatchInvariant };

void set_numerics(Numerics n);
Numerics numerics();
inline bool batch_invariant() { return numerics() == Numerics::kBatchInvariant; }

// How a mixture of experts runs its experts (model/transformer.h: grouped_experts()).
// kAuto: grouped GEMMs on CUDA (bf16, widths that are multiples of 8), the per-expert loop
// elsewhere. kGrouped: grouped wherever ATen can (the CPU too: its grouped GEMM is a loop of
// matmuls; the tests compare the two paths with it). kLoop: one matmul per expert, the routes
// grouped on the host. kBatchInvariant numerics always take the loop (its matmuls are the
// invariant ones). Process-wide like the numerics; set it before the first forward.
enum class ExpertKernels { kAuto, kGrouped, kLoop };
void set_expert_kernels(ExpertKernels k);
ExpertKernels expert_kernels();

// Sets the numerics for a scope and restores the previous setting after (tests).
class ScopedNumerics {
 public:
  explicit ScopedNumerics(Numerics n) : saved_(numerics()) { set_numerics(n); }
  ~ScopedNumerics() { set_numerics(saved_); }
  ScopedNumerics(const ScopedNumerics&) = delete;
  ScopedNumerics& operator=(const ScopedNumerics&) = delete;

 private:
  Numerics saved_;
};

// Sets the expert kernels for a scope and restores the previous setting after (tests, benchmarks).
class ScopedExpertKernels {
 public:
  explicit ScopedExpertKernels(ExpertKernels k) : saved_(expert_kernels()) { set_expert_kernels(k); }
  ~ScopedExpertKernels() { set_expert_kernels(saved_); }
  ScopedExpertKernels(const ScopedExpertKernels&) = delete;
  ScopedExpertKernels& operator=(const ScopedExpertKernels&) = delete;

 private:
  ExpertKernels saved_;
};

}  // namespace tiller::model
