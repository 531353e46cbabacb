// Advantage estimators by name (`algo.advantage_estimator`): a registry (core/registry.h) of
// records, each the estimator's function and the properties the rest of tiller asks instead of
// naming estimators: whether it needs a critic, whether it compares the samples of one prompt,
// whether its advantages come normalised (no whitening), and how the policy loss normalises.
//
// The built-ins, registered through the same call as a user's:
//   gae                 GAE with the critic's values (PPO)
//   reinforce           discounted reward-to-go (REINFORCE++; whitened)
//   rloo                r_i - mean of the other n - 1 samples of the prompt
//   reinforce_baseline  r_i - the prompt's mean
//   group_norm          (r_i - mean) / (std + eps) over the prompt's samples (GRPO)
//   dr_grpo             r_i - the prompt's mean, no whitening, the loss over a constant (Dr.GRPO)
//
// A trainer of one's own registers more before tiller::run_main:
//   tiller::algo::AdvantageEstimatorDef def;
//   def.group_baseline = true;
//   def.compute = [](const tiller::algo::AdvantageInputs& in) { ... return out; };
//   tiller::algo::register_advantage_estimator("my_estimator", def);
// and selects it with `algo.advantage_estimator: my_estimator` (docs/library.md).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/core/config.h"
#include "tiller/core/registry_api.h"

namespace tiller::algo {

// What an estimator sees of one step's rollout, on the host. Packed layout as in algo.h: per-token
// tensors [T] hold the response tokens of every sample back to back (multi-turn samples: only the
// model's own tokens), `cu` [B + 1] says where sample b's lie.
struct AdvantageInputs {
  at::Tensor scores;   // float [B]: each sample's score, shaped (overlong penalty, clipping, normalisation)
  at::Tensor rewards;  // float [T]: per-token rewards: the score on the sample's last token (a turn's
                       // reward on the turn's last), -kl_coef * kl on every token
  at::Tensor kl;       // float [T]: the KL estimate against the reference (zeros without one)
  double kl_coef = 0;  // the KL-in-reward coefficient in `rewards` (0 when KL is a loss term)
  at::Tensor values;   // float [T]: the critic's values; defined only for an estimator that needs a critic
  at::Tensor cu;       // int64 [B + 1]
  // Group estimators: the n samples of each prompt. group_order[g * n + i] is the index (into
  // scores' B) of prompt g's i-th sample; B = groups x n, every group complete.
  at::Tensor group_order;  // int64 [B]; defined only for an estimator with group_baseline
  int64_t n = 1;
  double gamma = 1.0, lambda = 0.95;
};

struct AdvantageOutputs {
  at::Tensor advantages;  // float [T]
  at::Tensor returns;     // float [T]: the critic's targets (needs_critic); may equal advantages otherwise
};

// How the policy loss divides its token sum for an optimizer step.
enum class LossNormalizer {
  kTokenMean,  // the step's trained tokens (a token mean over the step)
  kConstant,   // samples x max_new_tokens (Dr.GRPO: no length bias)
};

struct AdvantageEstimatorDef {
  std::function<AdvantageOutputs(const AdvantageInputs&)> compute;
  bool needs_critic = false;    // uses AdvantageInputs::values; its returns train the critic
  bool group_baseline = false;  // compares a prompt's samples: rollout.n_samples_per_prompt >= 2
  bool normalized = false;      // advantages normalised already: algo.whiten_advantages is not applied
  LossNormalizer loss_normalizer = LossNormalizer::kTokenMean;
  std::string summary;          // one line, for `tiller config --reference` and errors
};

// Adds an estimator; a ConfigError for an invalid name, one registered already, or no function.
// find_advantage_estimator: the estimator registered as `name`; a ConfigError naming
// algo.advantage_estimator, the registered names and the closest one otherwise.
TILLER_REGISTRY_API(advantage_estimator, AdvantageEstimatorDef);
// The lookup's old name, for one release.
inline const AdvantageEstimatorDef& advantage_estimator(const std::string& name) { return find_advantage_estimator(name); }

// The job's rules that depend on the algorithm's registered pieces (the advantage and KL estimators
// exist; a critic
// when it needs one and none otherwise; groups of two or more for a group baseline). `load_config`
// checks the rest; every command that loads a job calls this after it (load_job does both), and
// job::run_train checks it again for a job built in code.
void check_config(const JobConfig& job);
// load_config(path, overrides), then check_config.
JobConfig load_job(const std::string& path, const std::vector<std::string>& overrides = {});

}  // namespace tiller::algo
