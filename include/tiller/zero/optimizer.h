// AdamW on fp32 master shards, and learning-rate schedules.
//
// The update is PyTorch's AdamW (decoupled weight decay: p *= 1 - lr * wd, then the Adam step
// with bias correction), applied elementwise, so a shard updates exactly as the same elements of
// the unsharded parameter would. Weight decay is masked per element (norms, biases and padding
// take none; FlatLayout::decay_mask).
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace tiller {
struct TrainConfig;
}

namespace tiller::zero {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// The optimizer state of one shard. Not thread-safe; device of the master shard.
class ShardAdamW {
 public:
  // `master`: fp32 parameters (updated in place); `decay_mask`: same size, 1 where decay applies.
  ShardAdamW(at::Tensor master, at::Tensor decay_mask, AdamWConfig cfg);

  // One step with learning rate `lr`; `grad` is fp32 and the size of the shard.
  void step(const at::Tensor& grad, double lr);

  int64_t steps() const { return steps_; }
  const at::Tensor& master() const { return master_; }
  const at::Tensor& exp_avg() const { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  // Restores the state saved from exp_avg(), exp_avg_sq() and steps() (checkpoints).
  void load_state(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t steps);

 private:
  at::Tensor master_, mask_, exp_avg_, exp_avg_sq_;
  AdamWConfig cfg_;
  int64_t steps_ = 0;
};

// lr(step) = base_lr x factor(step), step counted from 0.
//   constant: 1 after warm-up
//   linear:   from 1 at the end of warm-up down to min_ratio at total_steps
//   cosine:   half a cosine from 1 down to min_ratio at total_steps
// Warm-up (all kinds): factor rises linearly, (step + 1) / warmup_steps, over the first
// warmup_steps steps, so the first step already moves the weights.
struct LrSchedule {
  std::string kind = "constant";
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_ratio = 0.0;

  double factor(int64_t step) const;
  // From train.lr_schedule / warmup_steps / min_lr_ratio / num_steps; ConfigError for an unknown kind.
  static LrSchedule from_config(const TrainConfig& train);
};

// min(1, max_norm / (total_norm + 1e-6)): the factor global-norm clipping scales gradients by.
double clip_coefficient(double total_norm, double max_norm);

}  // namespace tiller::zero
