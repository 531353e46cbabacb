// The off-policy correction of one step (private to src/controller), on the host: the engine's
// log-probs are the behaviour policy (the weights that sampled each token, possibly older ones in
// the asynchronous pipeline), the actor's log-probs scored before the step are the proximal
// policy that PPO's ratio is taken against. With d = proximal - behaviour per token:
//   tis        weight min(exp(d), cap) on each token's policy loss (truncated importance sampling)
//   decoupled  weight exp(d), tokens with exp(d) > cap masked to 0 (decoupled PPO; cap 0: none)
//   seq mask   a sample whose geometric-mean weight exp(mean d) is outside [1/r, r] is left out of
//              the actor's loss (algo.seq_mask_ratio)
// and the mismatch between the two policies, for the metrics.
#pragma once

#include <cstdint>
#include <vector>

#include "tiller/core/config.h"
#include "tiller/rollout/experience.h"
#include "tiller/rollout/metrics.h"

namespace tiller::rollout {

struct OffPolicySpec {
  ImportanceCorrection correction = ImportanceCorrection::kNone;
  double cap = 0;
  double seq_mask_ratio = 0;  // 0: off
  static OffPolicySpec from_job(const JobConfig& job);
};

struct OffPolicy {
  std::vector<float> weights;   // per response token; empty: no weights
  std::vector<uint8_t> masked;  // per sample: left out of the actor's loss
  int64_t masked_samples = 0;
  Metrics metrics;              // over the tokens drawn with the proximal weights: mismatch/kl (k3
                                // estimate of KL(behaviour || proximal), per token),
                                // mismatch/max_abs_logp_diff, mismatch/is_weight_mean,
                                // mismatch/tokens_compared and mismatch/tokens_differing; over the
                                // older versions' tokens (async): lag/kl, lag/max_abs_logp_diff,
                                // lag/is_weight_mean, lag/tokens; off_policy/* over all
};

// `proximal_version`: the weight version the actor scored the rollout with (the step's
// train_version). Tokens the engine drew with that same version are compared bit for bit
// (mismatch/tokens_differing of mismatch/tokens_compared: 0 under algo.logprob_match = bitwise);
// tokens of older versions (asynchronous rollouts) differ by design and are not counted there.
OffPolicy off_policy(const Rollout& ro, const OffPolicySpec& spec, uint64_t proximal_version);

}  // namespace tiller::rollout
