// The controller's prompt dataset: a JSONL or parquet file read once, templated and tokenized up
// front, then served in shuffled epochs from a resumable cursor.
//
// Each JSONL line, or parquet row (read through the embedded Python's pyarrow: python/parquet.h;
// a file ending in .parquet or .pq), is a JSON object. Keys may be dotted paths into nested
// objects ("reward_model.ground_truth"); a key that exists as written wins. `input_key` holds the
// prompt: text, put through the input template ("Question: {}\nAnswer:") and/or the chat
// template; or a list of chat messages ({"role", "content"}, verl's datasets), which needs the
// chat template. The result is encoded without special tokens (the chat template carries them).
// `label_key`, when present, is the label handed to rewards: a string, or any other JSON value
// kept as its JSON text (label_is_json). `data_source_key` (text) and `extra_info_key` (any JSON)
// go to Python rewards as verl's data_source and extra_info.
//
// Prompts longer than max_prompt_tokens follow a stated policy: skip them (counted and logged
// once with the first offending line), keep their last max_prompt_tokens tokens (truncate_left),
// or refuse the file (error). A malformed record is always refused: ConfigError "FILE:LINE: what"
// (JSONL) or "FILE: row N: what" (parquet).
//
// Order: epoch e is a permutation of the prompts drawn from (seed, e) by a fixed Fisher-Yates
// shuffle (the same on every platform), or file order without shuffling. The cursor (epoch,
// position) is all a checkpoint needs: seek() to it and next() continues where it stopped.
//
// Memory: the texts, labels and token ids of the whole file, on the host.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tiller/core/config.h"
#include "tiller/text/chat_template.h"
#include "tiller/data/epoch_order.h"

namespace tiller::model {
class Tokenizer;
}

namespace tiller::data {

using LongPromptPolicy = tiller::LongPromptPolicy;  // data.long_prompt_policy (tiller/core/config.h)

struct DatasetOptions {
  std::string input_key = "input";
  std::string label_key = "label";
  std::string data_source_key = "data_source";
  std::string extra_info_key = "extra_info";
  std::string input_template;                              // "" or one "{}"
  text::ChatTemplate chat;                                // none by default
  std::string tools_key = "tools";                         // a prompt's tool schemas (for chat templates)
  int64_t max_prompt_tokens = 1024;
  LongPromptPolicy long_prompts = LongPromptPolicy::kSkip;
  bool shuffle = true;
  uint64_t seed = 0;
  int64_t max_samples = 0;                                 // 0: every prompt
};

struct Prompt {
  int64_t line = 0;              // 1-based line (JSONL) or row (parquet) in the file
  std::string text;              // after the templates: what the engine reads
  // The record's prompt before the chat template (after data.input_template), for an agent harness
  // that makes its own messages; a record whose prompt is chat messages gives their JSON list.
  std::string input;
  std::vector<int64_t> tokens;
  std::string label;
  bool label_is_json = false;    // the label was not a string: `label` is its JSON text
  std::string data_source;       // "" when the record has none
  std::string extra_info;        // JSON text; "" when the record has none
};

class PromptDataset {
 public:
  // Reads, templates and tokenizes the whole file. ConfigError names the file and line or row (or
  // says that no prompt is left after the length policy).
  PromptDataset(const std::string& path, const text::Tokenizer& tokenizer, const DatasetOptions& options);

  int64_t size() const { return static_cast<int64_t>(prompts_.size()); }
  int64_t skipped() const { return skipped_; }      // over max_prompt_tokens, policy skip
  int64_t truncated() const { return truncated_; }  // policy truncate_left
  const Prompt& at(int64_t i) const { return prompts_.at(static_cast<size_t>(i)); }

  // The next n prompts (indices into at()), continuing into the next epoch when this one ends.
  std::vector<int64_t> next(int64_t n);
  DatasetCursor cursor() const { return order_.cursor(); }
  void seek(const DatasetCursor& c) { order_.seek(c, "prompts"); }  // ConfigError outside an epoch

 private:
  // Tokenizes a record's prompt (`where` names it in errors) and keeps it unless the length policy
  // skips it.
  void add_prompt(const std::string& where, Prompt p, const text::Tokenizer& tok);

  std::vector<Prompt> prompts_;
  DatasetOptions opts_;
  int64_t skipped_ = 0, truncated_ = 0;
  int64_t byte_limit_ = 0, bytes_per_token_ = 0;  // while reading: the length check before encoding
  EpochOrder order_;
};

}  // namespace tiller::data
