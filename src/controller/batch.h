// Micro-batches cut from the host arrays (experience.h) and their answers put back (private to
// src/controller): the one place where sample ids become packed tensors for a message and
// per-token answers go back to their samples.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/controller/experience.h"
#include "wire/messages.h"

namespace tiller::controller {

// `samples`' sequences back to back, with their lengths and prompt lengths.
wire::PackedSequences pack_sequences(const Rollout& ro, const std::vector<int64_t>& samples);
// A per-response-token array's values of `samples`, concatenated (float [sum of response lengths]).
at::Tensor gather_tokens(const Rollout& ro, const std::vector<float>& values, const std::vector<int64_t>& samples);
// The loss mask of `samples` (layout.turns), laid out as gather_tokens lays out values (uint8).
at::Tensor gather_mask(const Rollout& ro, const std::vector<int64_t>& samples);
// The inverse: `t` (float, as gather_tokens lays it out) into `values`. CommError when its size
// is not the samples' response tokens.
void scatter_tokens(const Rollout& ro, std::vector<float>& values, const std::vector<int64_t>& samples,
                    const at::Tensor& t);

}  // namespace tiller::controller
