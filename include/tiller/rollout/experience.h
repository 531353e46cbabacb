// The samples of one step as the controller holds them: compact host arrays, never a list of
// objects and never on a GPU (DESIGN.md §3). Samples are numbered in the order they joined;
// per-token arrays cover response tokens only, sample s's at [resp_offset[s], resp_offset[s] +
// response_len[s]).
//
// Memory per response token: 4 bytes of id, and 4 per float array the layout has (engine_logp,
// logp and advantages always; ref_logp with a reference model; values and returns with a
// critic); prompts add 4 bytes a token, samples a few words. 256 prompts x 16 samples x 8k
// tokens of GRPO with a reference is 33.5 M tokens: 0.67 GB.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tiller::rollout {

// Which optional per-token arrays a rollout keeps.
struct RolloutLayout {
  bool ref = false;     // ref_logp
  bool critic = false;  // values, returns
};

struct Rollout {
  explicit Rollout(RolloutLayout layout = {}) : layout(layout) {}

  RolloutLayout layout;
  // Per sample.
  std::vector<int64_t> prompt;        // its group's index in the step's batch
  std::vector<int64_t> sample;        // 0 .. n-1 within its group
  std::vector<int64_t> seq_offset;    // into tokens
  std::vector<int64_t> prompt_len, response_len;
  std::vector<int64_t> resp_offset;   // into the per-token arrays
  std::vector<uint8_t> truncated;     // stopped by max_new_tokens, not a stop token
  std::vector<float> score;           // the reward before KL and shaping
  // The weight versions that drew each sample's tokens, run-length coded (engine.h's
  // SampleOutput): sample s's runs are [run_offset[s], run_offset[s + 1]) of run_start (the
  // first response token of the run) and run_version.
  std::vector<int64_t> run_offset;
  std::vector<int64_t> run_start;
  std::vector<uint64_t> run_version;
  // Every sample's prompt + response ids back to back.
  std::vector<int32_t> tokens;
  // Per response token.
  std::vector<float> engine_logp, logp, advantages;
  std::vector<float> ref_logp;        // layout.ref
  std::vector<float> values, returns;  // layout.critic

  int64_t size() const { return static_cast<int64_t>(prompt.size()); }
  int64_t response_tokens() const { return static_cast<int64_t>(engine_logp.size()); }
  int64_t seq_len(int64_t s) const { return prompt_len[s] + response_len[s]; }
  // Appends a sample; its per-token arrays other than engine_logp are sized and zero-filled.
  // `version_starts`/`versions` are the engine's runs (empty: every token from `version`).
  int64_t add(int64_t prompt_index, int64_t sample_index, const std::vector<int64_t>& prompt_tokens,
              const std::vector<int64_t>& response, const std::vector<float>& engine_logprobs, bool hit_length,
              const std::vector<int64_t>& version_starts, const std::vector<uint64_t>& versions, uint64_t version);
  // Appends sample `s` of `other` (same layout), with every array it has.
  int64_t add_from(const Rollout& other, int64_t s, int64_t prompt_index);
  // The oldest and newest weight version among sample s's tokens.
  uint64_t oldest_version(int64_t s) const;
  uint64_t newest_version(int64_t s) const;
  // Sequence lengths of every sample (the packer's token counts).
  std::vector<int64_t> seq_lens() const;
  std::vector<int64_t> response_ids(int64_t s) const;
  void clear();
  size_t bytes() const;  // capacity held
};

}  // namespace tiller::rollout
