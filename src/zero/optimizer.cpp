#include "tiller/zero/optimizer.h"

#include <cmath>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"

namespace tiller::zero {

ShardAdamW::ShardAdamW(at::Tensor master, at::Tensor decay_mask, AdamWConfig cfg)
    : master_(std::move(master)), mask_(std::move(decay_mask)), cfg_(cfg) {
  TILLER_CHECK(master_.scalar_type() == at::kFloat, "AdamW master shards are fp32");
  TILLER_CHECK(mask_.numel() == master_.numel(), "decay mask of {} for a shard of {}", mask_.numel(), master_.numel());
  mask_ = mask_.to(master_.options());
  exp_avg_ = at::zeros_like(master_);
  exp_avg_sq_ = at::zeros_like(master_);
}

void ShardAdamW::step(const at::Tensor& grad, double lr) {
  TILLER_CHECK(grad.numel() == master_.numel() && grad.scalar_type() == at::kFloat, "AdamW gradient of {} ({}) for a shard of {}",
               grad.numel(), c10::toString(grad.scalar_type()), master_.numel());
  ++steps_;
  if (cfg_.weight_decay != 0) master_.mul_(1 - lr * cfg_.weight_decay * mask_);
  exp_avg_.lerp_(grad, 1 - cfg_.beta1);
  exp_avg_sq_.mul_(cfg_.beta2).addcmul_(grad, grad, 1 - cfg_.beta2);
  const double bc1 = 1 - std::pow(cfg_.beta1, static_cast<double>(steps_));
  const double bc2 = 1 - std::pow(cfg_.beta2, static_cast<double>(steps_));
  at::Tensor denom = (exp_avg_sq_.sqrt() / std::sqrt(bc2)).add_(cfg_.eps);
  master_.addcdiv_(exp_avg_, denom, -lr / bc1);
}

void ShardAdamW::load_state(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t steps) {
  TILLER_CHECK(exp_avg.numel() == master_.numel() && exp_avg_sq.numel() == master_.numel(),
               "optimizer state of {} elements for a shard of {}", exp_avg.numel(), master_.numel());
  exp_avg_.copy_(exp_avg.reshape({-1}));
  exp_avg_sq_.copy_(exp_avg_sq.reshape({-1}));
  steps_ = steps;
}

double LrSchedule::factor(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) return static_cast<double>(step + 1) / warmup_steps;
  if (kind == "constant") return 1.0;
  const int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  if (kind == "linear") return 1.0 - (1.0 - min_ratio) * progress;
  return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * progress));  // cosine
}

LrSchedule LrSchedule::from_config(const TrainConfig& t) {
  if (t.lr_schedule != "constant" && t.lr_schedule != "linear" && t.lr_schedule != "cosine")
    throw ConfigError(fmt::format("train.lr_schedule '{}': use constant, linear or cosine", t.lr_schedule));
  LrSchedule s;
  s.kind = t.lr_schedule;
  s.warmup_steps = t.warmup_steps;
  s.total_steps = t.num_steps;
  s.min_ratio = t.min_lr_ratio;
  return s;
}

double clip_coefficient(double total_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

}  // namespace tiller::zero
