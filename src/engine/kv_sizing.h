// How many KV-cache blocks an engine takes from the device memory free after its weights: the
// fraction engines.gpu_memory_fraction of it, but never so much that one step of
// engines.max_batched_tokens tokens has no room for its activations (a 7B engine at batch 64 of
// 4,096-token prompts, one 262,144-token step, needs ~18.5 GiB of them on an H200, more than the
// 15% that the default fraction leaves, and ran out of memory). Pure functions; private to src.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tiller/model/model_config.h"

namespace tiller::engine {

// An upper bound of the activations one step of `tokens` tokens holds at once in a TP rank of
// `tp` (bytes of `dtype_bytes` each): per token, the residual stream, the normed input and a
// block's output (3 x hidden), and the larger of the attention's (q/k/v and its output, this
// rank's heads) and the MLP's (gate, up and the activated rows, this rank's width; a mixture of
// experts: each routed expert's and the shared one's); then the logits of up to `sampled_rows`
// rows in fp32, twice (the log-softmax). About twice what the 7B step above measured: a bound.
inline int64_t step_activation_bytes(const model::ModelConfig& c, int64_t tokens, int64_t dtype_bytes, int64_t tp,
                                     int64_t sampled_rows) {
  tp = std::max<int64_t>(tp, 1);
  const int64_t attention = (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim / tp;
  int64_t mlp = 3 * c.intermediate_size / tp;
  if (c.num_experts > 0)
    mlp = std::max(mlp, 3 * (c.experts_per_token * c.moe_intermediate_size + c.shared_expert_intermediate_size) / tp);
  const int64_t per_token = (3 * c.hidden_size + std::max(attention, mlp)) * dtype_bytes;
  return tokens * per_token + 2 * std::min(sampled_rows, tokens) * c.vocab_size * 4;
}

// Blocks of `block_bytes` from `free_bytes`: `fraction` of it, or less so that `reserve_bytes`
// (the step's activations, with a margin) stay free; 0 when even that leaves nothing.
inline int64_t kv_blocks_for(int64_t free_bytes, double fraction, int64_t block_bytes, int64_t reserve_bytes) {
  if (block_bytes <= 0 || free_bytes <= 0) return 0;
  const auto by_fraction = static_cast<int64_t>(static_cast<double>(free_bytes) * fraction);
  const int64_t room = std::min(by_fraction, free_bytes - reserve_bytes);
  return room > 0 ? room / block_bytes : 0;
}

}  // namespace tiller::engine
