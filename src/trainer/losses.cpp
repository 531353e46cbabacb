#include "trainer/losses.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "model/host_upload.h"
#include "tiller/core/error.h"
#include "tiller/core/registry.h"

namespace tiller::trainer {
namespace {

// The trained tokens of a micro-batch's per-token arrays: the positions its loss mask keeps (all
// of them without a mask), on the forward's device.
class Trained {
 public:
  Trained(const at::Tensor& loss_mask, const at::Tensor& rows) : device_(rows.device()) {
    if (!loss_mask.defined()) return;
    TILLER_CHECK(loss_mask.numel() == rows.numel(), "a loss mask of {} for {} response rows", loss_mask.numel(),
                 rows.numel());
    kept_ = model::upload(at::nonzero(loss_mask.reshape({-1})).reshape({-1}), device_);
  }
  at::Tensor operator()(const at::Tensor& t) const {
    const at::Tensor d = model::upload(t, device_);
    return kept_.defined() ? d.index_select(0, kept_) : d;
  }

 private:
  at::Device device_;
  at::Tensor kept_;
};

// A registered loss's result as a scalar; an Error naming the loss (`kind` and `name`) otherwise.
at::Tensor scalar_loss(const char* kind, const std::string& name, const at::Tensor& loss) {
  if (!loss.defined() || loss.numel() != 1)
    throw Error(fmt::format("{} {}: it returned {}; return a scalar", kind, name,
                            loss.defined() ? fmt::format("{} values", loss.numel()) : "no loss"));
  return loss.reshape({});
}

// A loss's statistic as an fp64 scalar on `device`, detached; 0 when the loss left it undefined.
at::Tensor statistic(const at::Tensor& t, const at::Device& device) {
  return t.defined() ? t.detach().to(device, at::kDouble).reshape({})
                     : at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
}

}  // namespace

MicroBatchLoss actor_loss(const at::Tensor& logp_rows, const at::Tensor& entropy_rows, const wire::TrainActorRequest& in,
                          const ActorLossSpec& spec) {
  MicroBatchLoss out;
  const Trained pick(in.loss_mask, logp_rows);  // every per-token array at the same positions
  const at::Tensor logp = pick(logp_rows);
  out.tokens = logp.numel();
  if (out.tokens == 0) return out;
  const at::Tensor old = spec.old_is_forward ? logp.detach() : pick(in.old_logp);
  const at::Tensor is_w = in.is_weights.defined() ? pick(in.is_weights) : at::Tensor();
  algo::PolicyLossInputs pin;
  pin.logp = logp;
  pin.old_logp = old;
  pin.advantages = pick(in.advantages);
  pin.is_weights = is_w;
  if (in.ref_logp.defined()) pin.ref_logp = pick(in.ref_logp);
  pin.clip = spec.clip;
  pin.normalizer = in.normalizer;
  algo::PolicyLoss pl = algo::find_policy_loss(spec.policy_loss).compute(pin);
  out.loss = scalar_loss("policy loss", spec.policy_loss, pl.loss);
  pl.clipped_tokens = statistic(pl.clipped_tokens, logp.device());
  pl.kl_sum = statistic(pl.kl_sum, logp.device());
  if (in.kl_coef > 0 && in.ref_logp.defined())
    out.loss = out.loss + algo::kl_loss(logp, pick(in.ref_logp), spec.kl_estimator, in.kl_coef, in.normalizer);
  const at::Tensor entropy = pick(entropy_rows);
  if (spec.entropy_coef > 0) out.loss = out.loss + algo::entropy_bonus(entropy, spec.entropy_coef, in.normalizer);
  std::vector<at::Tensor> stats{out.loss.detach().to(at::kDouble), pl.clipped_tokens, pl.kl_sum,
                                 entropy.detach().to(at::kDouble).sum()};
  if (pl.metrics.size() > 16)
    throw Error(fmt::format("policy loss {}: {} metrics; report at most 16", spec.policy_loss, pl.metrics.size()));
  for (const auto& [name, value] : pl.metrics) {
    if (!valid_registry_name(name))
      throw Error(fmt::format("policy loss {}: a metric named '{}'; use 1 to 64 of a-z, 0-9, '_', '.', '-'",
                              spec.policy_loss, name));
    if (std::find(out.metric_names.begin(), out.metric_names.end(), name) != out.metric_names.end())
      throw Error(fmt::format("policy loss {}: the metric '{}' is reported twice", spec.policy_loss, name));
    if (!value.defined() || value.numel() != 1)
      throw Error(fmt::format("policy loss {}: its metric '{}' is {}; report one sum over the tokens",
                              spec.policy_loss, name, value.defined() ? fmt::format("{} values", value.numel()) : "undefined"));
    out.metric_names.push_back(name);
    stats.push_back(statistic(value, logp.device()));
  }
  out.stats = at::stack(stats);
  return out;
}

MicroBatchLoss critic_loss(const at::Tensor& value_rows, const wire::TrainCriticRequest& in, const CriticLossSpec& spec) {
  MicroBatchLoss out;
  const Trained pick(in.loss_mask, value_rows);
  const at::Tensor values = pick(value_rows);
  out.tokens = values.numel();
  if (out.tokens == 0) return out;
  algo::ValueLossInputs vin;
  vin.values = values;
  vin.old_values = pick(in.old_values);
  vin.returns = pick(in.returns);
  vin.clip = spec.value_clip;
  vin.normalizer = in.normalizer;
  algo::ValueLoss vl = algo::find_value_loss(spec.value_loss).compute(vin);
  out.loss = scalar_loss("value loss", spec.value_loss, vl.loss);
  const at::Tensor zero = statistic({}, values.device());
  out.stats = at::stack({out.loss.detach().to(at::kDouble), statistic(vl.clipped_tokens, values.device()), zero, zero});
  return out;
}

}  // namespace tiller::trainer
