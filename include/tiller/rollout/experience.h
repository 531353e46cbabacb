// The rollout of one step as the controller holds it: compact host arrays, never a list of
// objects and never on a GPU (DESIGN.md §3). Samples are numbered in the order their completions
// arrived; per-token arrays cover response tokens only, sample s's at [resp_offset[s],
// resp_offset[s] + response_len[s]).
//
// Memory: 8 bytes per token id plus 4 bytes per response token and per-token array, plus a few
// words per sample: 256 prompts x 16 samples x 8k tokens is ~0.5 GB of ids and ~1 GB of floats.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tiller::rollout {

struct Rollout {
  // Per sample.
  std::vector<int64_t> prompt;        // index into the step's prompts
  std::vector<int64_t> sample;        // 0 .. n-1 within its prompt
  std::vector<int64_t> seq_offset;    // into tokens
  std::vector<int64_t> prompt_len, response_len;
  std::vector<int64_t> resp_offset;   // into the per-token arrays
  std::vector<uint8_t> truncated;     // stopped by max_new_tokens, not a stop token
  std::vector<float> score;           // the reward before KL and shaping
  // Every sample's prompt + response ids back to back.
  std::vector<int64_t> tokens;
  // Per response token.
  std::vector<float> engine_logp, logp, ref_logp, values, advantages, returns;

  int64_t size() const { return static_cast<int64_t>(prompt.size()); }
  int64_t response_tokens() const { return static_cast<int64_t>(engine_logp.size()); }
  int64_t seq_len(int64_t s) const { return prompt_len[s] + response_len[s]; }
  // Appends a sample (its per-token arrays other than engine_logp are sized, zero-filled).
  int64_t add(int64_t prompt_index, int64_t sample_index, const std::vector<int64_t>& prompt_tokens,
              const std::vector<int64_t>& response, const std::vector<float>& engine_logprobs, bool hit_length);
  // Sequence lengths of every sample (the packer's token counts).
  std::vector<int64_t> seq_lens() const;
  std::vector<int64_t> response_ids(int64_t s) const;
  void clear();
  size_t bytes() const;  // capacity held
};

}  // namespace tiller::rollout
