// The RL algorithms as pure tensor functions (docs/algo.md): KL estimators, advantage
// estimators, whitening, the PPO policy and value losses, the KL controller, reward shaping and
// truncated importance sampling. No communication, no model: the controller and the trainer roles
// call them on host or device tensors. The per-sample scans (token_rewards, gae,
// discounted_returns) and RunningMoments run on the host, where the controller keeps the rollout,
// and return on the input's device; the losses run where their inputs are.
//
// Conventions. A batch of samples is packed: per-token tensors [T] hold the response tokens of
// every sample back to back, and `cu` (int64 [B + 1], cu[0] = 0, cu[B] = T) says where sample b's
// tokens lie: [cu[b], cu[b + 1]). Per-sample tensors are [B]. Groups (GRPO, RLOO) are n
// consecutive samples of one prompt. Losses return a *sum* over tokens divided by `normalizer`:
// for the token mean over a whole optimizer step across micro-batches and ranks, pass the step's
// total token count on every micro-batch (gradients then add up to that mean); Dr.GRPO passes a
// constant instead (samples x max_new_tokens).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/core/config.h"
#include "tiller/core/registry_api.h"

namespace tiller::algo {

// --- KL ---
// Per-token estimators of KL(policy || reference) from the sampled tokens' log-probs, by name
// (algo.kl_estimator) in a registry (core/registry.h; docs/library.md). Built in (Schulman,
// "Approximating KL divergence"), with d = logp - ref_logp: k1 = d, k2 = d^2 / 2,
// k3 = exp(-d) - 1 + d (unbiased and never negative). A user's: register_kl_estimator before
// tiller::run_main; `estimate` maps [T] log-probs to [T] estimates, differentiable in logp (the KL
// loss's gradient flows through it), on the inputs' device.
struct KlEstimatorDef {
  std::function<at::Tensor(const at::Tensor& logp, const at::Tensor& ref_logp)> estimate;
  std::string summary;  // one line
};
// A ConfigError for an invalid name, one registered already, or no function.
// find_kl_estimator: the estimator registered as `name`; a ConfigError naming algo.kl_estimator,
// the registered names and the closest one otherwise.
TILLER_REGISTRY_API(kl_estimator, KlEstimatorDef);
// The lookup's old name, for one release.
inline const KlEstimatorDef& kl_estimator(const std::string& name) { return find_kl_estimator(name); }
// The named estimator on these log-probs; its result is checked to be one value per token.
at::Tensor kl_estimate(const at::Tensor& logp, const at::Tensor& ref_logp, const std::string& estimator);

// --- Rewards ---
// Token rewards for KL in the reward: -kl_coef * kl on every token, plus each sample's score on
// its last token. scores [B], kl [T].
at::Tensor token_rewards(const at::Tensor& scores, const at::Tensor& kl, const at::Tensor& cu, double kl_coef);
// Scores clipped to [-clip, clip] (clip <= 0: unchanged).
at::Tensor clip_rewards(const at::Tensor& scores, double clip);

// Running mean and variance of everything seen (Chan et al.'s merge), for reward normalisation.
class RunningMoments {
 public:
  void update(const at::Tensor& x);
  // (x - mean) / std with the moments so far (after update, when called on the same batch).
  at::Tensor normalize(const at::Tensor& x, double eps = 1e-8) const;
  double mean() const { return mean_; }
  double std() const;
  int64_t count() const { return count_; }
  // Checkpoints: the sum of squared deviations, and restoring all three.
  double m2() const { return m2_; }
  void restore(double mean, double m2, int64_t count) {
    mean_ = mean;
    m2_ = m2;
    count_ = count;
  }

 private:
  double mean_ = 0, m2_ = 0;
  int64_t count_ = 0;
};

// --- Advantages ---
struct AdvantagesReturns {
  at::Tensor advantages;  // [T]
  at::Tensor returns;     // [T]
};
// Generalised advantage estimation within each sample (the value after its last token is 0).
AdvantagesReturns gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu, double gamma,
                      double lambda);
// Discounted reward-to-go within each sample (REINFORCE, REINFORCE++): advantages = returns.
at::Tensor discounted_returns(const at::Tensor& rewards, const at::Tensor& cu, double gamma);

// Per-sample advantages from scores within groups of n consecutive samples:
//   kRloo       r_i - mean of the other n - 1 (RLOO)
//   kMean       r_i - group mean (REINFORCE with baseline; Dr.GRPO)
//   kMeanStd    (r_i - group mean) / (group std + eps), std with Bessel's correction (GRPO)
enum class GroupBaseline { kRloo, kMean, kMeanStd };
at::Tensor group_advantages(const at::Tensor& scores, int64_t n, GroupBaseline kind, double eps = 1e-6);
// A per-sample value on every token of its sample: [B] -> [T].
at::Tensor per_token(const at::Tensor& per_sample, const at::Tensor& cu);
// (x - mean) / std over all of x (mean added back unless shift_mean).
at::Tensor whiten(const at::Tensor& x, bool shift_mean = true, double eps = 1e-8);

// --- Losses ---
struct PolicyLossConfig {
  double clip_low = 0.2;    // ratio lower bound 1 - clip_low
  double clip_high = 0.2;   // upper bound 1 + clip_high (asymmetric "clip-higher" when larger)
  double dual_clip = 0;     // > 1: for negative advantages the loss is capped at -dual_clip * A
};
struct PolicyLoss {
  at::Tensor loss;          // scalar: sum of per-token losses / normalizer (differentiable)
  // Statistics as fp64 scalars on the loss's device, so that computing a loss never waits for the
  // device (a trainer queues the next micro-batch meanwhile); the accessors read them (and wait).
  at::Tensor clipped_tokens;  // tokens whose clipped term was taken
  at::Tensor kl_sum;          // sum over tokens of (old_logp - logp)
  // A registered loss's own statistics: sums over the trained tokens (fp64 scalars on the loss's
  // device), reported per trained token of the step as actor/policy_loss/<name>. The same names
  // on every micro-batch; at most 16; names as registry names (tiller/core/registry.h).
  std::vector<std::pair<std::string, at::Tensor>> metrics;
  int64_t tokens = 0;
  double clip_fraction() const;  // clipped_tokens / tokens; 0 without tokens
  double approx_kl() const;      // kl_sum / tokens: the mean of (old_logp - logp)
};
// PPO's clipped surrogate. `is_weights` (optional, [T], no gradient) multiplies each token's loss:
// the truncated importance correction for engine vs trainer log-probs.
PolicyLoss policy_loss(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                       const PolicyLossConfig& cfg, double normalizer, const at::Tensor& is_weights = {});
// Plain policy gradient: -A * logp on every token (no ratio, no clipping: GPG's loss), the same
// sum / normalizer, is_weights and statistics as policy_loss (its clipped_tokens are 0). On-policy
// its gradient equals PPO's.
PolicyLoss pg_loss(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                   double normalizer, const at::Tensor& is_weights = {});

// Policy losses by name (algo.policy_loss), in a registry (core/registry.h; docs/library.md). The
// trainer rank calls the job's loss on each micro-batch's trained tokens and adds the KL loss and the
// entropy bonus itself. Built in: ppo (policy_loss above), pg (pg_loss). A user's: register before
// tiller::run_main; its loss is a differentiable scalar sum over tokens / normalizer on logp's device,
// and its statistics (fp64 scalars on the device; undefined: 0) feed actor/clip_fraction and
// actor/approx_kl.
struct PolicyLossInputs {
  at::Tensor logp;        // [T]: the trained tokens' log-probs under the policy being trained (differentiable)
  at::Tensor old_logp;    // [T]: under the policy that sampled them (the ratio's denominator)
  at::Tensor advantages;  // [T]
  at::Tensor is_weights;  // [T] or undefined: the truncated importance weights (engine vs trainer)
  at::Tensor ref_logp;    // [T] or undefined (no reference model)
  PolicyLossConfig clip;  // algo.clip_eps_low / clip_eps_high / dual_clip
  double normalizer = 1;
};
struct PolicyLossDef {
  std::function<PolicyLoss(const PolicyLossInputs&)> compute;
  std::string summary;  // one line
};
// A ConfigError for an invalid name, one registered already, or no function.
// find_policy_loss: the loss registered as `name`; a ConfigError naming algo.policy_loss, the
// registered names and the closest one otherwise.
TILLER_REGISTRY_API(policy_loss, PolicyLossDef);
// The lookup's old name, for one release.
inline const PolicyLossDef& policy_loss_def(const std::string& name) { return find_policy_loss(name); }

// Clipped value loss: 0.5 * max((v - R)^2, (old_v + clamp(v - old_v, +-clip) - R)^2) summed /
// normalizer (clip <= 0: unclipped). clip_fraction: tokens where the clipped term was larger.
struct ValueLoss {
  at::Tensor loss;
  at::Tensor clipped_tokens;  // fp64 scalar on the device, as PolicyLoss's
  int64_t tokens = 0;
  double clip_fraction() const;
};
ValueLoss value_loss(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, double clip,
                     double normalizer);

// Value losses by name (algo.value_loss), in a registry as the policy losses are. The critic's
// trainer rank calls the job's loss on each micro-batch's trained tokens. Built in: clipped
// (value_loss above, with algo.value_clip; 0 leaves it unclipped). A user's: register before
// tiller::run_main; its loss is a differentiable scalar sum over tokens / normalizer on the values'
// device, and its clipped_tokens (fp64 scalar on the device; undefined: 0) feed critic/clip_fraction.
struct ValueLossInputs {
  at::Tensor values;      // [T]: the trained tokens' values under the critic being trained (differentiable)
  at::Tensor old_values;  // [T]: the critic's values when the step was scored
  at::Tensor returns;     // [T]: the advantage estimator's returns
  double clip = 0;        // algo.value_clip
  double normalizer = 1;
};
struct ValueLossDef {
  std::function<ValueLoss(const ValueLossInputs&)> compute;
  std::string summary;  // one line
};
// A ConfigError for an invalid name, one registered already, or no function.
// find_value_loss: the loss registered as `name`; a ConfigError naming algo.value_loss, the
// registered names and the closest one otherwise.
TILLER_REGISTRY_API(value_loss, ValueLossDef);
// The lookup's old name, for one release.
inline const ValueLossDef& value_loss_def(const std::string& name) { return find_value_loss(name); }
// -coef * sum(entropy) / normalizer: added to the policy loss, it rewards entropy.
at::Tensor entropy_bonus(const at::Tensor& entropy, double coef, double normalizer);
// KL as a loss: coef * sum(kl_estimate(logp, ref_logp, k)) / normalizer (differentiable in logp).
at::Tensor kl_loss(const at::Tensor& logp, const at::Tensor& ref_logp, const std::string& estimator, double coef,
                   double normalizer);

// Truncated importance-sampling weights exp(trainer_logp - engine_logp) capped at `cap` (TIS):
// corrects for the engine sampling from slightly different probabilities than the trainer's.
at::Tensor truncated_is_weights(const at::Tensor& trainer_logp, const at::Tensor& engine_logp, double cap);

// --- KL coefficient ---
// Fixed (target <= 0) or adaptive (Ziegler et al.): after each step the coefficient is multiplied
// by 1 + clamp(kl / target - 1, -0.2, 0.2) * steps / horizon.
class KlController {
 public:
  KlController(double init_coef, double target = 0, double horizon = 10000);
  double value() const { return coef_; }
  void update(double current_kl, int64_t steps);

 private:
  double coef_, target_, horizon_;
};

}  // namespace tiller::algo
