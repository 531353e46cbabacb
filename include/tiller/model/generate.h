// Reference sampling straight from the functional model (a dense per-sequence KV cache, one
// batch at a time). It is slow next to the engine and exists to be the engine's reference:
// the same sampler (sampling.h), so equal logits give equal tokens and log-probs.
//
// Log-probs: each sampled token's log-probability under softmax(logits / temperature) of the
// full vocabulary (before top-k/top-p/min-p truncation); with greedy decoding, temperature 1.
// This is what the trainer computes for the same tokens at the same temperature.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tiller/model/model_config.h"
#include "tiller/model/sampling_params.h"
#include "tiller/model/weights.h"

namespace tiller::model {

struct Completion {
  std::vector<int64_t> tokens;    // generated ids, the stop token included when one ended it
  std::vector<float> logprobs;    // one per generated token
  std::string finish_reason;      // "stop" or "length"
};

// Samples a completion for every prompt, `batch_size` prompts at a time. Prompt ids must lie in
// the vocabulary and prompts must be non-empty (ConfigError otherwise).
std::vector<Completion> generate(const ModelConfig& cfg, const ModelWeights& w,
                                 const std::vector<std::vector<int64_t>>& prompts, const SamplingParams& params,
                                 int64_t batch_size = 16);

}  // namespace tiller::model
