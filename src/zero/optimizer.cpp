#include "tiller/zero/optimizer.h"

#include <cmath>
#include <optional>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"

namespace tiller::zero {

size_t ShardAdamW::add(at::Tensor master, const at::Tensor& decay_mask, at::Tensor grad) {
  TILLER_CHECK(master.scalar_type() == at::kFloat && master.dim() == 1 && master.is_contiguous(),
               "AdamW master shards are contiguous 1-d fp32");
  TILLER_CHECK(decay_mask.numel() == master.numel() && grad.numel() == master.numel() && grad.scalar_type() == at::kFloat,
               "AdamW shard of {}: decay mask of {} and gradient of {} ({})", master.numel(), decay_mask.numel(),
               grad.numel(), c10::toString(grad.scalar_type()));
  Shard s{master, grad.view({-1}), at::zeros_like(master), at::zeros_like(master)};
  // Runs of equal mask values, found on the host once.
  const at::Tensor mask = decay_mask.to(at::kCPU, at::kFloat).contiguous();
  const float* m = mask.data_ptr<float>();
  const int64_t n = master.numel();
  const at::Tensor step = at::full({}, static_cast<double>(steps_), master.options());
  for (int64_t b = 0; b < n;) {
    int64_t e = b + 1;
    while (e < n && (m[e] != 0) == (m[b] != 0)) ++e;
    Group& g = m[b] != 0 ? decayed_ : undecayed_;
    g.params.push_back(s.master.narrow(0, b, e - b));
    g.grads.push_back(s.grad.narrow(0, b, e - b));
    g.exp_avgs.push_back(s.exp_avg.narrow(0, b, e - b));
    g.exp_avg_sqs.push_back(s.exp_avg_sq.narrow(0, b, e - b));
    g.steps.push_back(step.clone());
    b = e;
  }
  shards_.push_back(std::move(s));
  return shards_.size() - 1;
}

void ShardAdamW::step(double lr, double grad_factor) {
  ++steps_;
  for (Group* g : {&decayed_, &undecayed_}) {
    if (g->params.empty()) continue;
    at::_foreach_add_(g->steps, 1.0);
    std::optional<at::Tensor> scale;
    if (grad_factor != 1.0) scale = at::full({}, 1.0 / grad_factor, g->params[0].options());  // grads / scale
    at::_fused_adamw_(g->params, g->grads, g->exp_avgs, g->exp_avg_sqs, {}, g->steps, lr, cfg_.beta1, cfg_.beta2,
                      g == &decayed_ ? cfg_.weight_decay : 0.0, cfg_.eps, /*amsgrad=*/false, /*maximize=*/false, scale);
  }
}

void ShardAdamW::load_state(size_t i, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
  TILLER_CHECK(i < shards_.size(), "no optimizer shard {}", i);
  Shard& s = shards_[i];
  TILLER_CHECK(exp_avg.numel() == s.master.numel() && exp_avg_sq.numel() == s.master.numel(),
               "optimizer state of {} elements for a shard of {}", exp_avg.numel(), s.master.numel());
  s.exp_avg.copy_(exp_avg.reshape({-1}));
  s.exp_avg_sq.copy_(exp_avg_sq.reshape({-1}));
}

void ShardAdamW::set_steps(int64_t steps) {
  steps_ = steps;
  for (Group* g : {&decayed_, &undecayed_})
    for (auto& t : g->steps) t.fill_(static_cast<double>(steps));
}

std::vector<at::Tensor> ShardAdamW::state_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& s : shards_) {
    out.push_back(s.exp_avg);
    out.push_back(s.exp_avg_sq);
  }
  for (const Group* g : {&decayed_, &undecayed_}) out.insert(out.end(), g->steps.begin(), g->steps.end());
  return out;
}

int64_t ShardAdamW::state_bytes() const {
  int64_t b = 0;
  for (const auto& s : shards_) b += 2 * s.exp_avg.numel() * static_cast<int64_t>(sizeof(float));
  return b;
}

double LrSchedule::factor(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) return static_cast<double>(step + 1) / warmup_steps;
  if (kind == LrScheduleKind::kConstant) return 1.0;
  const int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  if (kind == LrScheduleKind::kLinear) return 1.0 - (1.0 - min_ratio) * progress;
  return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * progress));  // cosine
}

LrSchedule LrSchedule::from_config(const TrainConfig& t) {
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
