#include "tiller/algo/preference.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::algo {
namespace {

void check_pairs(const char* what, std::initializer_list<const at::Tensor*> ts) {
  const at::Tensor& first = **ts.begin();
  TILLER_CHECK(first.defined() && first.dim() == 1, "{}: one value per pair ([P] tensors)", what);
  for (const at::Tensor* t : ts)
    TILLER_CHECK(t->defined() && t->dim() == 1 && t->size(0) == first.size(0),
                 "{}: tensors of {} and {} values; give one value per pair in each", what, first.numel(),
                 t->defined() ? t->numel() : 0);
}

// The statistics of chosen/rejected rewards, without gradient.
void add_stats(PreferenceLoss& out, const at::Tensor& chosen, const at::Tensor& rejected) {
  at::NoGradGuard no_grad;
  const at::Tensor c = chosen.detach().to(at::kDouble), r = rejected.detach().to(at::kDouble);
  out.chosen_reward_sum = c.sum();
  out.rejected_reward_sum = r.sum();
  out.correct = (c > r).sum().to(at::kDouble);
  out.margin_sum = (c - r).sum();
  out.pairs = c.numel();
}

}  // namespace

at::Tensor sequence_logps(const at::Tensor& logp, const at::Tensor& mask, const at::Tensor& cu, bool average) {
  TILLER_CHECK(logp.dim() == 1 && mask.dim() == 1 && mask.numel() == logp.numel(),
               "sequence_logps: {} log-probs, {} mask values", logp.numel(), mask.numel());
  const at::Tensor c = cu.to(at::kCPU, at::kLong).contiguous();
  const int64_t b = c.numel() - 1;
  TILLER_CHECK(b >= 0 && c.data_ptr<int64_t>()[b] == logp.numel() && c.data_ptr<int64_t>()[0] == 0,
               "sequence_logps: cu does not span the {} tokens", logp.numel());
  const at::Tensor m = mask.to(logp.device(), logp.scalar_type());
  const at::Tensor seg = at::repeat_interleave(at::arange(b, at::kLong), c.diff()).to(logp.device());
  at::Tensor sums = at::zeros({b}, logp.options()).index_add(0, seg, logp * m);
  if (average) sums = sums / at::zeros({b}, m.options()).index_add(0, seg, m).clamp_min(1);
  return sums;
}

PreferenceLoss bradley_terry_loss(const at::Tensor& chosen, const at::Tensor& rejected, const at::Tensor& margin) {
  if (margin.defined()) check_pairs("bradley_terry_loss", {&chosen, &rejected, &margin});
  else check_pairs("bradley_terry_loss", {&chosen, &rejected});
  at::Tensor diff = chosen - rejected;
  if (margin.defined()) diff = diff - margin.to(diff.scalar_type());
  PreferenceLoss out;
  out.losses = -at::log_sigmoid(diff);
  add_stats(out, chosen, rejected);
  return out;
}

PreferenceLoss dpo_loss(const at::Tensor& policy_chosen, const at::Tensor& policy_rejected,
                        const at::Tensor& ref_chosen, const at::Tensor& ref_rejected, const DpoOptions& o) {
  check_pairs("dpo_loss", {&policy_chosen, &policy_rejected, &ref_chosen, &ref_rejected});
  if (!(o.beta > 0)) throw ConfigError(fmt::format("DPO beta = {}: it must be > 0", o.beta));
  if (!(o.label_smoothing >= 0 && o.label_smoothing < 0.5))
    throw ConfigError(fmt::format("DPO label smoothing = {}: it must be in [0, 0.5)", o.label_smoothing));
  if (o.type == DpoLossType::kIpo && o.label_smoothing != 0)
    throw ConfigError("DPO label smoothing is cDPO's, for the sigmoid loss; IPO takes none");
  const at::Tensor rc = ref_chosen.detach(), rr = ref_rejected.detach();
  const at::Tensor h = (policy_chosen - policy_rejected) - (rc - rr).to(policy_chosen.scalar_type());
  PreferenceLoss out;
  if (o.type == DpoLossType::kIpo) {
    out.losses = (h - 1.0 / (2.0 * o.beta)).pow(2);
  } else {
    const double eps = o.label_smoothing;
    out.losses = -at::log_sigmoid(o.beta * h) * (1.0 - eps);
    if (eps > 0) out.losses = out.losses - at::log_sigmoid(-o.beta * h) * eps;
  }
  add_stats(out, o.beta * (policy_chosen.detach() - rc), o.beta * (policy_rejected.detach() - rr));
  return out;
}

}  // namespace tiller::algo
