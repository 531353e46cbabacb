// AdamW on the host, for optimizer offload (roles.<r>.optimizer_offload: cpu; docs/zero.md).
//
// The fp32 masters and both AdamW moments of a rank's shards live in host memory for the whole
// run; the device keeps only the compute-dtype shards (what the all-gathers read) and the fp32
// gradient accumulators. A step streams each shard's gradient to the host in chunks on a copy
// stream, a pool of threads updates the chunk with a vectorised loop, and the new compute-dtype
// values stream back on the same copy stream, so the host-to-device copies, the update and the
// device-to-host copies of three different chunks overlap. Device memory per parameter: 2 bytes
// of bf16 shard and 4 of gradient, against 18 with the optimizer on the device.
//
// The update is PyTorch's AdamW as aten::_fused_adamw_ computes it (the kernel ShardAdamW runs):
//   g /= grad_scale; p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// in fp32 with the step's scalars rounded to fp32 once, without fused multiply-adds, so every
// vector width gives the same bits; it matches ATen's kernels to fp32 rounding (a few ulps: they
// may contract or order the operations differently; tests/zero/layout_optimizer_test.cpp states
// the tolerance). The compute-dtype copy is the master rounded to nearest even, as Tensor::copy_.
//
// Threading: one caller thread at a time; step() blocks until the new shards are on the device
// (ordered before the caller's stream's next kernels) and the host state is updated.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/zero/optimizer.h"

namespace tiller::zero {

// The scalars of one AdamW step, in fp32 as the update uses them.
struct AdamWScalars {
  float beta1 = 0, beta2 = 0, eps = 0;
  float decay = 1;                   // 1 - lr * weight_decay (1 where no decay applies)
  float step_size = 0;               // lr / (1 - beta1^t)
  float bias_correction2_sqrt = 1;   // sqrt(1 - beta2^t)
  float grad_scale = 1;              // gradients are divided by it
  // Step t (counted from 1), gradients multiplied by `grad_factor` (clipping), decay on or off.
  static AdamWScalars make(const AdamWConfig& cfg, double lr, int64_t t, double grad_factor, bool decay);
};

// Where the updated parameters are also written, rounded: bf16, fp16 or fp32 (or nothing).
enum class RoundedOut { kNone, kBFloat16, kHalf, kFloat };

// One AdamW update of n contiguous elements in place (one thread), the update above; `out`, when
// not kNone, receives the new parameters rounded to its dtype.
void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWScalars& s,
                  void* out, RoundedOut out_kind);

// The optimizer state of a rank's shards on the host, and the step that streams through it.
class HostAdamW {
 public:
  // `device`: where the gradients and compute shards live (a CUDA device, or the CPU in tests,
  // where no copy is made). `threads` > 0: the update's threads (the caller is one of them).
  // `chunk_elements`: elements per streamed chunk (> 0).
  HostAdamW(AdamWConfig cfg, at::Device device, int threads, int64_t chunk_elements = int64_t{1} << 22);
  ~HostAdamW();
  HostAdamW(const HostAdamW&) = delete;
  HostAdamW& operator=(const HostAdamW&) = delete;

  // Registers a shard of `numel` elements: its fp32 master on the host (zero: fill it through
  // master()), zero moments; `decay_mask` (numel, any device) is 1 where weight decay applies.
  size_t add(int64_t numel, const at::Tensor& decay_mask);

  // One step with learning rate `lr` over every shard: grads[i] (fp32 on the device, numel of
  // shard i) multiplied by `grad_factor`, and compute[i] (on the device, bf16/fp16/fp32) set to
  // the new master rounded. The gradients are read only; the caller's stream's work that wrote
  // them is waited for.
  void step(double lr, double grad_factor, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& compute);

  int64_t steps() const;
  void set_steps(int64_t steps);
  size_t size() const;
  int threads() const;
  // Host fp32 tensors of shard i (the master may be written: loading a checkpoint or weights).
  const at::Tensor& master(size_t i) const;
  const at::Tensor& exp_avg(size_t i) const;
  const at::Tensor& exp_avg_sq(size_t i) const;
  void load_state(size_t i, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq);
  int64_t host_bytes() const;  // masters, moments and the staging buffers

  // Where the last step's seconds went (the caller's wall clock): waiting for the device-to-host
  // copies, updating on the host, in all.
  struct Timing {
    double copy_wait_s = 0, update_s = 0, total_s = 0;
  };
  Timing last_timing() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The update's threads when none are given: the cores of this host divided by the ranks that
// share it (OMPI_COMM_WORLD_LOCAL_SIZE / MPI_LOCALNRANKS / 1), at least 1.
int default_optimizer_threads();

}  // namespace tiller::zero
