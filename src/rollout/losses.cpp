#include "rollout/losses.h"

#include <ATen/ATen.h>

#include "tiller/core/error.h"

namespace tiller::rollout {
namespace {

// The positions a loss mask keeps (int64 on `device`), or undefined: all of them.
at::Tensor kept_rows(const at::Tensor& loss_mask, int64_t rows, const at::Device& device) {
  if (!loss_mask.defined()) return {};
  TILLER_CHECK(loss_mask.numel() == rows, "a loss mask of {} for {} response rows", loss_mask.numel(), rows);
  return at::nonzero(loss_mask.reshape({-1})).reshape({-1}).to(device);
}

}  // namespace

MicroBatchLoss actor_loss(const at::Tensor& logp_rows, const at::Tensor& entropy_rows, const TrainActorRequest& in,
                          const ActorLossSpec& spec) {
  MicroBatchLoss out;
  const at::Device device = logp_rows.device();
  const at::Tensor kept = kept_rows(in.loss_mask, logp_rows.numel(), device);
  // The trained tokens only; every per-token array is taken at the same positions.
  auto pick = [&](const at::Tensor& t) {
    const at::Tensor d = t.to(device);
    return kept.defined() ? d.index_select(0, kept) : d;
  };
  const at::Tensor logp = pick(logp_rows);
  out.tokens = logp.numel();
  if (out.tokens == 0) return out;
  const at::Tensor old = spec.old_is_forward ? logp.detach() : pick(in.old_logp);
  const at::Tensor is_w = in.is_weights.defined() ? pick(in.is_weights) : at::Tensor();
  algo::PolicyLoss pl = algo::policy_loss(logp, old, pick(in.advantages), spec.clip, in.normalizer, is_w);
  out.loss = pl.loss;
  if (in.kl_coef > 0 && in.ref_logp.defined())
    out.loss = out.loss + algo::kl_loss(logp, pick(in.ref_logp), spec.kl_estimator, in.kl_coef, in.normalizer);
  const at::Tensor entropy = pick(entropy_rows);
  if (spec.entropy_coef > 0) out.loss = out.loss + algo::entropy_bonus(entropy, spec.entropy_coef, in.normalizer);
  out.clip_fraction = pl.clip_fraction;
  out.approx_kl = pl.approx_kl;
  out.entropy_sum = entropy.detach().sum().item<double>();
  return out;
}

MicroBatchLoss critic_loss(const at::Tensor& value_rows, const TrainCriticRequest& in, double value_clip) {
  MicroBatchLoss out;
  const at::Device device = value_rows.device();
  const at::Tensor kept = kept_rows(in.loss_mask, value_rows.numel(), device);
  auto pick = [&](const at::Tensor& t) {
    const at::Tensor d = t.to(device);
    return kept.defined() ? d.index_select(0, kept) : d;
  };
  const at::Tensor values = pick(value_rows);
  out.tokens = values.numel();
  if (out.tokens == 0) return out;
  algo::ValueLoss vl = algo::value_loss(values, pick(in.old_values), pick(in.returns), value_clip, in.normalizer);
  out.loss = vl.loss;
  out.clip_fraction = vl.clip_fraction;
  return out;
}

}  // namespace tiller::rollout
