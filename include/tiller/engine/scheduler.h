// The continuous-batching scheduler: which sequences compute how many tokens in the next step.
//
// A function of its inputs only (the sequences' states, the limits, the KV block manager's free
// blocks), so it is tested without a model or a GPU; the engine applies the plan (TensorRT-LLM's
// capacity / micro-batch schedulers are shaped the same way).
//
// Policy, in order:
//  1. Running sequences, oldest first, each get what they still need: one token when decoding,
//     the rest of the prompt (or of a recomputation) when prefilling. With chunked prefill a long
//     prompt takes what is left of the step's token budget and continues next step.
//  2. When the KV blocks for a running sequence's tokens are not free, the newest running
//     sequence is preempted (its blocks released; it goes back to waiting and is recomputed from
//     its tokens later), until the blocks suffice or the sequence itself is the newest: then it is
//     preempted.
//  3. Waiting sequences are admitted first come, first served while the token budget,
//     max_num_seqs (counted in seats) and the free blocks allow, never skipping one that does
//     not fit, and not in a step that preempted.
// Parked sessions (multi-turn: the KV cache of finished samples kept for their next turn) give
// their blocks up first: before rule 2 preempts a running sequence, and when rule 3 would leave a
// waiting one out for want of blocks that evicting them frees, parked sessions are evicted, oldest
// first.
// The engine must refuse up front a request whose tokens could never fit: more blocks than the
// cache, more seats than max_num_seqs, or, without chunked prefill, prompt + max_new_tokens over
// max_batched_tokens (a preempted sequence is recomputed, generated tokens included, in one
// step).
#pragma once

#include <cstdint>
#include <vector>

#include "tiller/engine/kv_block_manager.h"

namespace tiller::engine {

struct SchedulerLimits {
  int64_t max_num_seqs = 256;
  int64_t max_batched_tokens = 8192;
  bool chunked_prefill = true;
};

struct SeqState {
  int64_t id = 0;
  int64_t num_tokens = 0;    // prompt + generated so far
  int64_t num_computed = 0;  // tokens whose K/V are in the cache: table->tokens when running, 0 waiting
  const BlockTable* table = nullptr;  // running sequences only
  // Sequences this one counts as against max_num_seqs: n for a prompt whose n samples fork from
  // it once its prefill is done, else 1.
  int64_t seats = 1;
};

// Tokens [start, start + count) of sequence `id` are computed this step.
struct ScheduledChunk {
  int64_t id = 0;
  int64_t start = 0;
  int64_t count = 0;
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // running sequences first, then the admitted ones
  std::vector<int64_t> admitted;       // from waiting to running
  std::vector<int64_t> preempted;      // from running back to waiting (release their blocks)
  std::vector<int64_t> evicted;        // parked sessions whose blocks are released
  int64_t num_tokens = 0;
};

// `running` and `waiting` in priority order (oldest first); `parked` in eviction order (oldest
// first), each with its table.
StepPlan schedule(const SchedulerLimits& limits, const std::vector<SeqState>& running,
                  const std::vector<SeqState>& waiting, const KvBlockManager& kv,
                  const std::vector<SeqState>& parked = {});

}  // namespace tiller::engine
