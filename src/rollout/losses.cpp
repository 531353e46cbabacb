#include "rollout/losses.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "model/host_upload.h"
#include "tiller/core/error.h"
#include "tiller/core/registry.h"

namespace tiller::rollout {
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

}  // namespace

MicroBatchLoss actor_loss(const at::Tensor& logp_rows, const at::Tensor& entropy_rows, const TrainActorRequest& in,
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
  algo::PolicyLoss pl = algo::policy_loss_def(spec.policy_loss).compute(pin);
  if (!pl.loss.defined() || pl.loss.numel() != 1)
    throw Error(fmt::format("policy loss {}: it returned {}; return a scalar", spec.policy_loss,
                            pl.loss.defined() ? fmt::format("{} values", pl.loss.numel()) : "no loss"));
  auto stat = [&](const at::Tensor& t) {
    return t.defined() ? t.detach().to(logp.device(), at::kDouble).reshape({})
                       : at::zeros({}, logp.options().dtype(at::kDouble));
  };
  pl.clipped_tokens = stat(pl.clipped_tokens);
  pl.kl_sum = stat(pl.kl_sum);
  out.loss = pl.loss.reshape({});
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
    stats.push_back(value.detach().to(logp.device(), at::kDouble).reshape({}));
  }
  out.stats = at::stack(stats);
  return out;
}

MicroBatchLoss critic_loss(const at::Tensor& value_rows, const TrainCriticRequest& in, const CriticLossSpec& spec) {
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
  algo::ValueLoss vl = algo::value_loss_def(spec.value_loss).compute(vin);
  if (!vl.loss.defined() || vl.loss.numel() != 1)
    throw Error(fmt::format("value loss {}: it returned {}; return a scalar", spec.value_loss,
                            vl.loss.defined() ? fmt::format("{} values", vl.loss.numel()) : "no loss"));
  out.loss = vl.loss.reshape({});
  const at::Tensor zero = at::zeros({}, values.options().dtype(at::kDouble));
  const at::Tensor clipped =
      vl.clipped_tokens.defined() ? vl.clipped_tokens.detach().to(values.device(), at::kDouble).reshape({}) : zero;
  out.stats = at::stack({out.loss.detach().to(at::kDouble), clipped, zero, zero});
  return out;
}

}  // namespace tiller::rollout
