// The activations of the memory plan that only the plan itself uses (private to src/job;
// train_activation_bytes and the recompute order are public, tiller/job/memory_plan.h).
#pragma once

#include <cstdint>

#include "tiller/model/model_config.h"

namespace tiller::job {

// A scoring pass's activations for `tokens` tokens (no autograd: one block's intermediates, the
// hidden states in and out, the LM head's fp32 logits chunk and its log-softmax).
int64_t score_activation_bytes(const model::ModelConfig& c, int64_t tokens, int64_t bytes);

}  // namespace tiller::job
