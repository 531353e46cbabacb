// The samples of one step as the controller holds them: compact host arrays, never a list of
// objects and never on a GPU (docs/architecture.md). Samples are numbered in the order they joined;
// per-token arrays cover response tokens only, sample s's at [resp_offset[s], resp_offset[s] +
// response_len[s]).
//
// Memory per response token: 4 bytes of id, and 4 per float array the layout has (engine_logp,
// logp and advantages always; ref_logp with a reference model; values and returns with a
// critic; 1 byte of loss mask with multi-turn samples); prompts add 4 bytes a token, samples a
// few words. 256 prompts x 16 samples x 8k tokens of GRPO with a reference is 33.5 M tokens: 0.67 GB.
//
// Multi-turn samples (layout.turns): the response is every turn after the prompt, the model's
// sampled tokens and the environment's observations back to back; the loss mask says which
// tokens the model sampled (only they are trained and counted in token means), and each model
// turn has the environment's reward for it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tiller::controller {

// Which optional per-token arrays a rollout keeps.
struct RolloutLayout {
  bool ref = false;     // ref_logp
  bool critic = false;  // values, returns
  bool turns = false;   // loss_mask, turn_* (multi-turn samples)
};

// A multi-turn sample's extra arrays (Rollout::add).
struct TurnInfo {
  std::vector<uint8_t> loss_mask;  // per response token: 1 sampled by the model, 0 an observation's
                                   // (all 0: a sample its loop discarded; none of it is trained)
  std::vector<int64_t> ends;       // per model turn: its last token's index in the response
  std::vector<float> rewards;      // per model turn: the environment's reward
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
  std::vector<float> score;           // the reward before KL and shaping (with turns: the outcome's;
                                      // total_reward() adds the turns')
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
  // layout.turns: per response token, and sample s's turns [turn_offset[s], turn_offset[s + 1]).
  std::vector<uint8_t> loss_mask;
  std::vector<int64_t> turn_offset, turn_end;
  std::vector<float> turn_reward;
  // Routing replay (engine.h's SampleOutput::routes): sample s's experts per token at
  // [route_offset[s], route_offset[s + 1]) of `routes`, seq_len(s) rows of route_width (2 bytes
  // each), or nothing when the engine recorded none. Rows the engine never computed (the last
  // token, observations after the last turn) hold -1: the trainer routes them itself.
  std::vector<int16_t> routes;
  std::vector<int64_t> route_offset;
  int64_t route_width = 0;

  int64_t size() const { return static_cast<int64_t>(prompt.size()); }
  int64_t response_tokens() const { return static_cast<int64_t>(engine_logp.size()); }
  int64_t seq_len(int64_t s) const { return prompt_len[s] + response_len[s]; }
  // The model's tokens of sample s's response (all of them without layout.turns).
  int64_t model_tokens(int64_t s) const;
  int64_t turns(int64_t s) const { return layout.turns ? turn_offset[s + 1] - turn_offset[s] : 1; }
  // score plus the environment's rewards of every turn.
  double total_reward(int64_t s) const;
  // Appends a sample; its per-token arrays other than engine_logp are sized and zero-filled.
  // `version_starts`/`versions` are the engine's runs (empty: every token from `version`).
  // `turn_info`: a multi-turn sample's (layout.turns; null: one turn, every token the model's).
  int64_t add(int64_t prompt_index, int64_t sample_index, const std::vector<int64_t>& prompt_tokens,
              const std::vector<int64_t>& response, const std::vector<float>& engine_logprobs, bool hit_length,
              const std::vector<int64_t>& version_starts, const std::vector<uint64_t>& versions, uint64_t version,
              const TurnInfo* turn_info = nullptr);
  // The engine's routes of the sample added last: `rows` [n, width], n <= its seq_len (the rest -1).
  // Every sample's width is the same.
  void set_routes(const std::vector<int16_t>& rows, int64_t width);
  bool has_routes(int64_t s) const { return route_offset[s + 1] > route_offset[s]; }
  // Appends sample `s` of `other` (same layout), with every array it has.
  int64_t add_from(const Rollout& other, int64_t s, int64_t prompt_index);
  // Puts the samples in (prompt, sample) order, every array with them, in place (one array's copy
  // at a time). Samples are appended as they arrive, which timing decides; the step's sums over
  // samples and tokens (whitening, reward normalisation, the KL metric, a user's estimator) then
  // add in an order that does not depend on it. Returns false when the order was already so.
  bool canonicalize();
  // The oldest and newest weight version among sample s's tokens.
  uint64_t oldest_version(int64_t s) const;
  uint64_t newest_version(int64_t s) const;
  // Sequence lengths of every sample (the packer's token counts).
  std::vector<int64_t> seq_lens() const;
  std::vector<int64_t> response_ids(int64_t s) const;
  void clear();
  size_t bytes() const;  // capacity held
};

}  // namespace tiller::controller
