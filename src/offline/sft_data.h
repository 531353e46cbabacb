// The samples of supervised fine-tuning (private to src/offline): conversations or prompt/response
// pairs from a JSONL or parquet file (data/records.h: errors name file:line), tokenized with
// the chat template, each with the mask of the tokens the loss trains.
//
// What is trained. A conversation is rendered turn by turn; the tokens each turn adds are encoded
// on their own, so the mask's boundaries are exactly the turns' (the concatenation decodes to the
// whole conversation as apply_chat_template writes it). Every assistant turn's content and its
// end-of-turn marker are trained (the model learns to stop); the assistant header ("<|im_start|>
// assistant\n"), system, user and tool turns are not. A prompt/response record is the conversation
// [user: prompt, assistant: response]; without a chat template it is the prompt's text (through the
// input template) then the response and the tokenizer's EOS, the response and EOS trained.
//
// Threading: none; built once, then read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tiller/text/chat_template.h"

namespace tiller::text {
class Tokenizer;
}  // namespace tiller::text

namespace tiller::offline {

// A sample over max_tokens: left out (counted), cut to its first max_tokens tokens, or an error.
enum class LongSamples { kSkip, kTruncate, kError };

struct SftDataOptions {
  std::string messages_key = "messages";  // a list of {"role", "content"}
  std::string tools_key = "tools";        // a list of tool schemas for the chat template (absent: none)
  std::string prompt_key = "prompt";      // or a prompt and a response, as text
  std::string response_key = "response";
  std::string input_template;             // "" or one "{}": the prompt of prompt/response records
  text::ChatTemplate chat;
  std::optional<int64_t> eos_id;          // without a chat template: ends each response (trained)
  int64_t max_tokens = 2048;
  LongSamples long_samples = LongSamples::kSkip;
  int64_t max_samples = 0;                // 0: every record
  std::string path_key = "the data path";  // the config key that gave the file, for errors
};

struct SftSample {
  int64_t line = 0;                 // 1-based line (JSONL) or row (parquet)
  std::vector<int64_t> tokens;
  std::vector<uint8_t> loss_mask;   // per token: 1 when the loss trains its prediction (from the token before)
  int64_t trained() const;          // tokens the loss trains
};

// The tokens and loss mask of one conversation (see above); only the assistant turns from message
// `first_trained` on are trained (a preference pair's response after its shared prompt).
// ConfigError, prefixed by `where`, for a role other than system, user, assistant or tool, no
// assistant turn to train, no chat template, or a template that does not extend the conversation
// turn by turn. `tools_json`: a JSON list of tool schemas the template renders ("" none).
SftSample encode_conversation(const std::string& where, const std::vector<text::ChatMessage>& messages,
                              const text::Tokenizer& tok, const text::ChatTemplate& chat, size_t first_trained = 0,
                              const std::string& tools_json = "");
// Applies the length policy to `s` (`where` names it): false when it is left out (over max_tokens
// under kSkip, counted in `skipped`, or cut before its first trained token); cut under kTruncate
// (counted in `truncated`); ConfigError under kError.
bool apply_length_policy(const std::string& where, SftSample& s, int64_t max_tokens, LongSamples policy,
                         int64_t& skipped, int64_t& truncated);

// A prompt/response pair (see above).
SftSample encode_pair(const std::string& where, const std::string& prompt, const std::string& response,
                      const text::Tokenizer& tok, const SftDataOptions& o, const std::string& tools_json = "");

// A held-out split of `n` samples: `eval` of them drawn with `seed`, the others for training, each
// in file order. ConfigError unless 0 <= eval < n.
struct HeldOutSplit {
  std::vector<int64_t> train, eval;
};
HeldOutSplit held_out_split(int64_t n, int64_t eval, uint64_t seed);

class SftDataset {
 public:
  // Reads and encodes every record; ConfigError naming file:line for a bad record, and when no
  // sample is left.
  SftDataset(const std::string& path, const text::Tokenizer& tok, const SftDataOptions& o);

  int64_t size() const { return static_cast<int64_t>(samples_.size()); }
  const SftSample& at(int64_t i) const { return samples_.at(static_cast<size_t>(i)); }
  int64_t skipped() const { return skipped_; }      // over max_tokens (kSkip)
  int64_t truncated() const { return truncated_; }  // cut to max_tokens (kTruncate)

  using Split = HeldOutSplit;
  Split split(int64_t eval, uint64_t seed) const { return held_out_split(size(), eval, seed); }

 private:
  std::vector<SftSample> samples_;
  int64_t skipped_ = 0, truncated_ = 0;
};

}  // namespace tiller::offline
