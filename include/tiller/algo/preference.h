// The losses of preference learning as pure tensor functions (docs/algo.md, "Preference losses"):
// the Bradley-Terry loss of a reward model on chosen/rejected pairs, and DPO (with cDPO's label
// smoothing, or IPO). No model, no communication: the reward-model and DPO trainers call them on
// the scores or sequence log-probs of a micro-batch's pairs.
//
// Conventions. Inputs are [P] (one value per pair), on any device, float or double. The loss comes
// back per pair, differentiable, so that the caller divides its sum by the optimizer step's pairs
// across micro-batches and ranks (as the PPO losses divide by the step's tokens); the statistics
// come back as sums over the pairs, for the same all-reduce, as fp64 scalars on the inputs' device
// (computing a loss never waits for the device, as algo.h's PolicyLoss).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace tiller::algo {

struct PreferenceLoss {
  at::Tensor losses;          // [P], differentiable in the inputs
  // Sums over the pairs (fp64 scalars, no gradient): the chosen and rejected rewards (a reward
  // model's scores; DPO's implicit rewards beta * (policy - reference)), pairs whose chosen reward
  // is higher, and the margins chosen - rejected.
  at::Tensor chosen_reward_sum, rejected_reward_sum, correct, margin_sum;
  int64_t pairs = 0;
};

// Bradley-Terry: -log sigmoid(chosen - rejected - margin) per pair, with `margin` [P] (undefined:
// none), as Llama 2's reward models and OpenRLHF's PairWiseLoss. Statistics of the scores
// themselves (the margin only shifts the loss).
PreferenceLoss bradley_terry_loss(const at::Tensor& chosen, const at::Tensor& rejected,
                                  const at::Tensor& margin = at::Tensor());

// Each sequence's log-prob of its response: the sum over its trained tokens (`mask` [T], 1 on the
// response's tokens) of `logp` [T], or with `average` their mean (IPO's); packed as in algo.h, `cu`
// [B + 1] on the host (as the packer makes it; on the device it is read back, a wait). [B],
// differentiable in logp. A sequence without trained tokens is 0.
at::Tensor sequence_logps(const at::Tensor& logp, const at::Tensor& mask, const at::Tensor& cu, bool average);

enum class DpoLossType { kSigmoid, kIpo };

struct DpoOptions {
  double beta = 0.1;
  // cDPO (Mitchell, 2023): the chance a pair's label is flipped, in [0, 0.5); sigmoid loss only.
  double label_smoothing = 0;
  DpoLossType type = DpoLossType::kSigmoid;
};

// DPO over sequence log-probs (the sum over each response's tokens; for IPO the mean over them, as
// TRL computes it), with h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected):
//   sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
//   ipo      (h - 1 / (2 beta))^2
// The rewards are beta (policy - reference) of the chosen and rejected responses. The reference's
// log-probs carry no gradient. ConfigError for beta <= 0 or label smoothing outside [0, 0.5), or
// label smoothing with IPO.
PreferenceLoss dpo_loss(const at::Tensor& policy_chosen, const at::Tensor& policy_rejected,
                        const at::Tensor& ref_chosen, const at::Tensor& ref_rejected, const DpoOptions& options);

}  // namespace tiller::algo
