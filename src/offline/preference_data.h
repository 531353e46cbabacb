// The pairs of reward-model training and DPO (private to src/offline): a prompt with a chosen and a
// rejected response, from a JSONL or parquet file (errors name file:line), each response tokenized
// after the shared prompt as SFT data is (sft_data.h).
//
// A record's prompt (prompt_key) is text or a list of chat messages, or absent when the responses
// are whole conversations; each response (chosen_key, rejected_key) is text (the assistant's
// answer) or a list of messages (the turns after the prompt). The loss mask of a side marks its
// response's assistant tokens only, never the prompt's, so a DPO sequence log-prob is the
// response's. margin_key (optional, a number) is the Bradley-Terry margin of the pair.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "offline/sft_data.h"

namespace tiller::offline {

struct PreferenceDataOptions {
  std::string prompt_key = "prompt";
  std::string chosen_key = "chosen";
  std::string rejected_key = "rejected";
  std::string margin_key = "margin";   // "" or absent in a record: no margin
  std::string input_template;          // "" or one "{}": a text prompt
  text::ChatTemplate chat;
  std::optional<int64_t> eos_id;       // without a chat template: ends each response
  int64_t max_tokens = 2048;           // each side's tokens
  LongSamples long_samples = LongSamples::kSkip;
  int64_t max_samples = 0;             // pairs; 0: every record
  std::string path_key = "the data path";
};

struct PreferencePair {
  int64_t line = 0;
  SftSample chosen, rejected;
  double margin = 0;
  // Both sequences' tokens: the pair's rows in a micro-batch.
  int64_t rows() const { return static_cast<int64_t>(chosen.tokens.size() + rejected.tokens.size()); }
};

class PreferenceDataset {
 public:
  PreferenceDataset(const std::string& path, const text::Tokenizer& tok, const PreferenceDataOptions& o);

  int64_t size() const { return static_cast<int64_t>(pairs_.size()); }
  const PreferencePair& at(int64_t i) const { return pairs_.at(static_cast<size_t>(i)); }
  int64_t skipped() const { return skipped_; }      // a side over max_tokens (kSkip)
  int64_t truncated() const { return truncated_; }  // a side cut to max_tokens (kTruncate)
  bool has_margins() const { return margins_; }     // some record gave one
  SftDataset::Split split(int64_t eval, uint64_t seed) const;

 private:
  std::vector<PreferencePair> pairs_;
  int64_t skipped_ = 0, truncated_ = 0;
  int64_t long_sides_ = 0;  // sides left out (the length policy warns at the first)
  bool margins_ = false;
};

// The rows of the pairs `ids` of `data`: an optimizer step's, which weigh the router losses.
inline double pair_rows(const PreferenceDataset& data, const std::vector<int64_t>& ids) {
  int64_t n = 0;
  for (int64_t id : ids) n += data.at(id).rows();
  return static_cast<double>(std::max<int64_t>(n, 1));
}

}  // namespace tiller::offline
