// The losses of one trainer micro-batch (private to src/trainer): what an actor or critic rank
// computes from its forward's response rows and the controller's per-token arrays (messages.h).
//
// The loss mask of multi-turn samples is applied here: observation tokens take no part in the
// loss (so no gradient reaches the model through them), in the token counts, or in the clip and
// KL statistics; the normalizer (the optimizer step's model tokens) comes with the request.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/algo/algo.h"
#include "wire/messages.h"

namespace tiller::trainer {

struct MicroBatchLoss {
  at::Tensor loss;          // scalar, differentiable; undefined when no token of the micro-batch trains
  // The statistics over the trained tokens, as fp64 [4] on the loss's device (reading them would
  // wait for the device): the loss (detached), tokens whose clipped term was taken, the sum of old -
  // new log-prob (actor), the sum of entropies (actor). Undefined with the loss.
  at::Tensor stats;
  int64_t tokens = 0;       // trained tokens
  // The policy loss's named statistics: stats[4 + i] is the sum of metric_names[i].
  std::vector<std::string> metric_names;
};

struct ActorLossSpec {
  algo::PolicyLossConfig clip;
  std::string kl_estimator = "k1";  // a registered KL estimator
  std::string policy_loss = "ppo";  // a registered policy loss
  double entropy_coef = 0;
  bool old_is_forward = false;  // train.old_logprobs = forward: the ratio's old log-probs are these
};

// `logp` and `entropy`: float [R], the forward's values at the request's response rows (on the
// model's device; logp differentiable).
MicroBatchLoss actor_loss(const at::Tensor& logp, const at::Tensor& entropy, const wire::TrainActorRequest& in,
                          const ActorLossSpec& spec);
struct CriticLossSpec {
  std::string value_loss = "clipped";  // a registered value loss
  double value_clip = 0.2;
};
// `values`: float [R] at the response rows (differentiable).
MicroBatchLoss critic_loss(const at::Tensor& values, const wire::TrainCriticRequest& in, const CriticLossSpec& spec);

}  // namespace tiller::trainer
