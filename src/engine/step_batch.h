// One engine step as plain host data: what the leader schedules and, under tensor parallelism,
// broadcasts to the other ranks of its TP group, which derive every device input from it the
// same way (model_runner.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "tiller/engine/kv_block_manager.h"
#include "tiller/model/sampling.h"

namespace tiller::engine {

struct StepBatch {
  std::vector<int64_t> tokens, positions;      // [T], sequence after sequence
  std::vector<int64_t> lens_q;                 // new tokens per sequence
  std::vector<int64_t> lens_k;                 // cached + new tokens per sequence
  std::vector<std::vector<BlockId>> tables;    // per sequence: the blocks holding its lens_k tokens
  std::vector<BlockCopy> copies;               // copy-on-write, before the forward
  std::vector<int64_t> sample_rows;            // rows of `tokens` whose logits are sampled (may repeat)
  model::SamplingRows sampling;                // one entry per sample row
  // Asynchronous scheduling: tokens[prev_rows[i]] is a placeholder for draw prev_draws[i] of the
  // step launched before this one, whose ids the host has not seen yet. Not sent to TP followers.
  std::vector<int64_t> prev_rows, prev_draws;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(lens_q.size()); }
  // Decode only: every sequence computes one token.
  bool is_decode() const;

  // A flat int64 message (floats bit-cast) and back; decode() checks the framing.
  std::vector<int64_t> encode() const;
  static StepBatch decode(const std::vector<int64_t>& message);
};

}  // namespace tiller::engine
