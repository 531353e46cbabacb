// The off-policy correction of one step (private to src/controller), on the host: the engine's
// log-probs are the behaviour policy (the weights that sampled each token, possibly older ones in
// the asynchronous pipeline), the actor's log-probs scored before the step are the proximal
// policy that PPO's ratio is taken against. With d = proximal - behaviour per token, and w the
// level's weight (token: exp(d); sequence: exp(sum of the sample's d), the same for each of its
// tokens; geometric: exp(mean of the sample's d)):
//   tis        weight min(w, cap) on each token's policy loss (truncated importance sampling)
//   mis        weight w where lower <= w <= cap, else 0: the token (or the sample) masked
//   decoupled  weight exp(d), tokens with exp(d) > cap masked to 0 (decoupled PPO; cap 0: none)
//   seq mask   a sample whose geometric-mean weight exp(mean d) is outside [1/r, r] is left out of
//              the actor's loss (algo.seq_mask_ratio)
//   veto       a sample with a token whose exp(d) is below `veto` is left out of the actor's loss
//              (the engine drew a token the trainer finds near impossible; algo.is_veto)
// and the mismatch between the two policies, for the metrics.
#pragma once

#include <cstdint>
#include <vector>

#include "tiller/controller/experience.h"
#include "tiller/controller/metrics.h"
#include "tiller/core/config.h"

namespace tiller::controller {

struct OffPolicySpec {
  ImportanceCorrection correction = ImportanceCorrection::kNone;
  double cap = 0;
  double seq_mask_ratio = 0;  // 0: off
  IsLevel level = IsLevel::kToken;  // tis and mis
  double cap_lower = 0;             // mis; 0: 1 / cap
  double veto = 0;                  // 0: off
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
                                // lag/is_weight_mean, lag/tokens; off_policy/* over all:
                                // is_weight_mean, the level's weights' quantiles (is_weight_min,
                                // _p05, _p50, _p95, _max, to 1% from a log histogram) and their
                                // effective sample share (is_ess: (sum w)^2 / (n sum w^2)),
                                // mismatch_k1 (mean of -d), and the shares and counts the
                                // correction truncated, masked and rejected
};

// `proximal_version`: the weight version the actor scored the rollout with (the step's
// train_version). Tokens the engine drew with that same version are compared bit for bit
// (mismatch/tokens_differing of mismatch/tokens_compared: 0 under algo.logprob_match = bitwise);
// tokens of older versions (asynchronous rollouts) differ by design and are not counted there.
OffPolicy off_policy(const Rollout& ro, const OffPolicySpec& spec, uint64_t proximal_version);

}  // namespace tiller::controller
