// Rewards, KL and advantages of one step, on the host (private to src/controller): a pure function
// of the step's arrays, the algorithm's spec (its enums parsed when the config was loaded) and
// the state that carries over between steps (the KL coefficient, the reward moments), which it
// returns updated instead of changing.
//
// In order: the score of each sample (rule, remote or reward model), DAPO's overlong penalty,
// clipping, running normalisation; the KL estimate per token (with a reference model), in the
// reward or left to the loss; then the registered estimator (tiller/algo/advantage_estimator.h:
// GAE with the critic's values, discounted returns, a group baseline over each prompt's n samples,
// or a user's), and whitening unless the estimator's advantages come normalised.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "tiller/algo/advantage_estimator.h"
#include "tiller/algo/algo.h"
#include "tiller/controller/experience.h"
#include "tiller/controller/metrics.h"
#include "tiller/core/config.h"

namespace tiller::controller {

struct AdvantageSpec {
  std::string estimator = "gae";  // a registered advantage estimator
  std::string kl_estimator = "k1";  // a registered KL estimator
  bool kl_in_reward = true;
  bool have_ref = false;
  double gamma = 1.0, lambda = 0.95;
  bool whiten = true;
  double reward_clip = 0;  // 0: off
  bool normalize_rewards = false;
  int64_t n = 1;           // samples per group
  int64_t overlong_buffer = 0;
  double overlong_penalty = 1.0;
  int64_t max_new_tokens = 0;
  double distill_coef = 0;  // on-policy distillation from the reference (the teacher); 0: off

  static AdvantageSpec from_job(const JobConfig& job, bool have_ref);
  // The estimator's record says its advantages are normalised already (GRPO's mean/std; Dr.GRPO,
  // which removes the std on purpose): whitening is skipped.
  bool skips_whitening() const;
};

struct AdvantageState {
  double kl_coef = 0;
  algo::RunningMoments reward_moments;
};

struct AdvantageResult {
  std::vector<float> advantages;           // per response token, in the rollout's layout
  std::vector<float> returns;              // the same, with a critic (layout.critic); else empty
  AdvantageState state;                    // reward moments after this step (kl_coef unchanged)
  double kl_mean_per_sample = 0;           // for the KL controller
  Metrics metrics;                         // reward/, advantages/, kl/, response_length/, ...
};

// DAPO's soft overlong penalty of a response of `length` tokens (0 when off or short enough).
double overlong_penalty(int64_t length, int64_t max_new_tokens, int64_t buffer, double penalty);

// `ro` has n consecutive-or-not samples per group (ro.prompt, ro.sample); every group complete.
AdvantageResult compute_advantages(const Rollout& ro, const AdvantageSpec& spec, const AdvantageState& state);

}  // namespace tiller::controller
