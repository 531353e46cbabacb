// Supervised fine-tuning's loss as a pure tensor function (docs/algo.md, "Supervised fine-tuning"):
// the negative log-likelihood of the trained tokens, averaged over tokens or over sequences.
//
// Conventions as in algo.h: per-token tensors [T] are packed, `cu` ([B + 1]) says where each
// sequence's tokens lie, and the loss is a sum divided by `normalizer`, so that micro-batches and
// ranks add up to the optimizer step's mean: the step's trained tokens (token mean: transformers'
// causal-LM loss with the untrained labels at -100), or its sequences (sequence mean: each
// sequence's own mean, then their mean).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace tiller::algo {

enum class SftMean { kToken, kSequence };

struct SftLoss {
  at::Tensor loss;    // scalar, differentiable in logp
  // fp64 scalars on logp's device, no gradient (reading them waits for the device; computing them
  // does not): the trained tokens' summed negative log-likelihood, and their count.
  at::Tensor nll, tokens;
};

// `logp` [T]: each row's log-prob of its target; `mask` [T] (uint8 or bool): 1 where the row's
// target is trained. ConfigError-free: sizes are checked (TILLER_CHECK); normalizer > 0.
SftLoss sft_loss(const at::Tensor& logp, const at::Tensor& mask, const at::Tensor& cu, SftMean mean, double normalizer);

// The same loss from per-row weights, for rows that need not be whole sequences (one rank's slice
// under sequence parallelism): `weight` [T] is 1 for the token mean, and 1 / (the trained tokens
// of the row's whole sequence) for the sequence mean; rows outside `mask` add nothing. Over whole
// sequences it equals sft_loss; summed over a sequence group's slices, sft_loss of the whole row.
SftLoss sft_loss_weighted(const at::Tensor& logp, const at::Tensor& mask, const at::Tensor& weight, double normalizer);

}  // namespace tiller::algo
