#include "tiller/algo/advantage_estimator.h"

#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/algo/algo.h"
#include "tiller/core/registry.h"

namespace tiller::algo {
namespace {

AdvantageOutputs gae_estimate(const AdvantageInputs& in) {
  AdvantagesReturns ar = gae(in.rewards, in.values, in.cu, in.gamma, in.lambda);
  return {ar.advantages, ar.returns};
}

AdvantageOutputs reinforce_estimate(const AdvantageInputs& in) {
  at::Tensor adv = discounted_returns(in.rewards, in.cu, in.gamma);
  return {adv, adv};
}

// A per-sample group baseline on every token of the sample; with KL in the reward, each token also
// carries the discounted KL penalty that follows it.
AdvantageOutputs group_estimate(const AdvantageInputs& in, GroupBaseline kind) {
  at::Tensor grouped = group_advantages(in.scores.index_select(0, in.group_order), in.n, kind);
  at::Tensor per_sample = at::empty_like(grouped);
  per_sample.index_copy_(0, in.group_order, grouped);
  at::Tensor adv = per_token(per_sample, in.cu);
  if (in.kl_coef > 0)
    adv = adv + discounted_returns(token_rewards(at::zeros_like(in.scores), in.kl, in.cu, in.kl_coef), in.cu,
                                   in.gamma);
  return {adv, adv};
}

AdvantageEstimatorDef group_def(GroupBaseline kind, bool normalized, LossNormalizer norm, std::string summary) {
  AdvantageEstimatorDef d;
  d.compute = [kind](const AdvantageInputs& in) { return group_estimate(in, kind); };
  d.group_baseline = true;
  d.normalized = normalized;
  d.loss_normalizer = norm;
  d.summary = std::move(summary);
  return d;
}

// The registry, the built-ins added on first use (through the same call as a user's).
Registry<AdvantageEstimatorDef>& registry() {
  static Registry<AdvantageEstimatorDef>* r = [] {
    auto* reg = new Registry<AdvantageEstimatorDef>(
        "advantage estimator", [](const AdvantageEstimatorDef& d) { return d.compute ? "" : "no compute function"; });
    AdvantageEstimatorDef gae_def;
    gae_def.compute = gae_estimate;
    gae_def.needs_critic = true;
    gae_def.summary = "GAE with the critic's values (PPO)";
    reg->add("gae", std::move(gae_def));
    AdvantageEstimatorDef reinforce_def;
    reinforce_def.compute = reinforce_estimate;
    reinforce_def.summary = "discounted reward-to-go (REINFORCE++)";
    reg->add("reinforce", std::move(reinforce_def));
    reg->add("rloo", group_def(GroupBaseline::kRloo, false, LossNormalizer::kTokenMean,
                                        "score minus the mean of the prompt's other samples (RLOO)"));
    reg->add("reinforce_baseline",
                group_def(GroupBaseline::kMean, false, LossNormalizer::kTokenMean,
                          "score minus the prompt's mean (REINFORCE with baseline)"));
    reg->add("group_norm", group_def(GroupBaseline::kMeanStd, true, LossNormalizer::kTokenMean,
                                              "score normalised by the prompt's mean and std (GRPO)"));
    reg->add("dr_grpo", group_def(GroupBaseline::kMean, true, LossNormalizer::kConstant,
                                           "score minus the prompt's mean, loss over a constant (Dr.GRPO)"));
    return reg;
  }();
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(advantage_estimator, AdvantageEstimatorDef, registry, "algo.advantage_estimator")

void check_config(const JobConfig& job) {
  // A step's samples split into mini-batches of train.train_batch_size (an RL job's rule: the
  // offline trainers read train.train_batch_size as records per step and skip check_config).
  const std::int64_t samples = job.rollout.batch_size * job.rollout.n_samples_per_prompt;
  if (samples % job.train.train_batch_size != 0)
    throw ConfigError(fmt::format("train.train_batch_size = {} must divide rollout.batch_size x "
                                  "rollout.n_samples_per_prompt = {}",
                                  job.train.train_batch_size, samples));
  // LoRA: the engines load the actor's base and receive its adapters (docs/training.md, LoRA).
  if (job.roles.actor.lora.rank > 0 && !job.engines.model.empty() && job.engines.model != job.roles.actor.model)
    throw ConfigError(fmt::format("engines.model = {}: with roles.actor.lora the engines run the actor's base ({}) with "
                                  "its adapters, and a sync sends the adapters alone; leave engines.model empty",
                                  job.engines.model, job.roles.actor.model));
  if (job.ref_is_actor_base() && job.roles.ref.dtype != job.roles.actor.dtype)
    throw ConfigError(fmt::format("roles.ref.dtype = {} differs from roles.actor.dtype = {}: with roles.actor.lora the "
                                  "reference is the actor's own base with its adapters off; set them equal, or give "
                                  "roles.ref.model to load a separate reference",
                                  enum_name(job.roles.ref.dtype), enum_name(job.roles.actor.dtype)));
  find_kl_estimator(job.algo.kl_estimator);
  find_policy_loss(job.algo.policy_loss);
  find_value_loss(job.algo.value_loss);
  const std::string& name = job.algo.advantage_estimator;
  const AdvantageEstimatorDef& est = find_advantage_estimator(name);
  if (est.needs_critic && !job.roles.critic.enabled) {
    std::vector<std::string> without;
    for (const std::string& n : advantage_estimator_names())
      if (!find_advantage_estimator(n).needs_critic) without.push_back(n);
    throw ConfigError(fmt::format("algo.advantage_estimator = {} needs a critic; set roles.critic.enabled=true or "
                                  "choose one without: {}",
                                  name, fmt::join(without, ", ")));
  }
  if (!est.needs_critic && job.roles.critic.enabled)
    throw ConfigError(
        fmt::format("algo.advantage_estimator = {} does not use a critic; set roles.critic.enabled=false", name));
  if (est.group_baseline && job.rollout.n_samples_per_prompt < 2)
    throw ConfigError(fmt::format("algo.advantage_estimator = {} compares samples of one prompt; set "
                                  "rollout.n_samples_per_prompt >= 2 (it is {})",
                                  name, job.rollout.n_samples_per_prompt));
}

JobConfig load_job(const std::string& path, const std::vector<std::string>& overrides) {
  JobConfig job = load_config(path, overrides);
  check_config(job);
  return job;
}

}  // namespace tiller::algo
