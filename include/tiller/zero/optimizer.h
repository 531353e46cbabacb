// AdamW on fp32 master shards, and learning-rate schedules.
//
// The update is PyTorch's AdamW (decoupled weight decay: p *= 1 - lr * wd, then the Adam step
// with bias correction), run by ATen's fused multi-tensor kernel (aten::_fused_adamw_, the kernel
// behind torch.optim.AdamW(fused=True), on CPU and CUDA) over every shard of a rank at once. It
// is elementwise, so a shard updates as the same elements of the unsharded parameter would.
// Weight decay is masked per element: norms, biases and padding take none (FlatLayout::decay_mask);
// each shard is split into its runs of decayed and undecayed elements once, at add().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/core/config.h"


namespace tiller::zero {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// The optimizer state of a rank's shards. Not thread-safe; state lives on each master's device.
class ShardAdamW {
 public:
  explicit ShardAdamW(AdamWConfig cfg) : cfg_(cfg) {}

  // Registers an fp32 shard, updated in place by step(); `decay_mask` (same numel) is 1 where
  // weight decay applies. Returns the shard's index. Its gradients must stay at the same storage
  // for every step (the trainer's fp32 gradient accumulators).
  size_t add(at::Tensor master, const at::Tensor& decay_mask, at::Tensor grad);

  // One step with learning rate `lr`; gradients are multiplied by `grad_factor` first (global-norm
  // clipping) and are garbage afterwards.
  void step(double lr, double grad_factor = 1.0);

  int64_t steps() const { return steps_; }
  size_t size() const { return shards_.size(); }
  const at::Tensor& master(size_t i) const { return shards_[i].master; }
  const at::Tensor& exp_avg(size_t i) const { return shards_[i].exp_avg; }
  const at::Tensor& exp_avg_sq(size_t i) const { return shards_[i].exp_avg_sq; }
  // Restores the moments saved from exp_avg(i) / exp_avg_sq(i), and the step count (checkpoints).
  void load_state(size_t i, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq);
  void set_steps(int64_t steps);
  // Bytes of optimizer state (moments) held by this rank.
  int64_t state_bytes() const;
  // Every tensor of the state (moments, step counts): what an offload moves.
  std::vector<at::Tensor> state_tensors() const;

 private:
  struct Shard {
    at::Tensor master, grad, exp_avg, exp_avg_sq;
  };
  // Aligned runs of one shard, as views: the lists the fused kernel takes, per decay kind.
  struct Group {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  };
  AdamWConfig cfg_;
  std::vector<Shard> shards_;
  Group decayed_, undecayed_;
  int64_t steps_ = 0;
};

// lr(step) = base_lr x factor(step), step counted from 0.
//   constant: 1 after warm-up
//   linear:   from 1 at the end of warm-up down to min_ratio at total_steps
//   cosine:   half a cosine from 1 down to min_ratio at total_steps
// Warm-up (all kinds): factor rises linearly, (step + 1) / warmup_steps, over the first
// warmup_steps steps, so the first step already moves the weights.
struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kConstant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_ratio = 0.0;

  double factor(int64_t step) const;
  // From train.lr_schedule / warmup_steps / min_lr_ratio / num_steps.
  static LrSchedule from_config(const TrainConfig& train);
};

// min(1, max_norm / (total_norm + 1e-6)): the factor global-norm clipping scales gradients by.
double clip_coefficient(double total_norm, double max_norm);

}  // namespace tiller::zero
