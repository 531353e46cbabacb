// Tokenizers: Hugging Face `tokenizer.json` byte-level BPE (GPT-2, Llama-3, Qwen2 and the like)
// and SentencePiece `tokenizer.model` files, behind one interface.
//
// Encodings equal those of the `tokenizers` library for the byte-level BPE files it writes
// (normalizers NFC/NFD/NFKC/NFKD, pre-tokenizers ByteLevel/Split/Digits/Sequence, added and
// special tokens with lstrip/rstrip/single_word, TemplateProcessing post-processors). A file
// using anything else is rejected when loaded, naming the JSON key, never tokenized differently.
//
// Thread-safe: encode and decode are const and may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tiller::model {
struct ModelConfig;
}  // namespace tiller::model

namespace tiller::text {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Text -> ids. Special tokens written in the text become their ids. With add_special_tokens
  // the tokenizer's template is applied (e.g. Llama-3 prepends <|begin_of_text|>).
  virtual std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = false) const = 0;
  // Ids -> text (invalid UTF-8 from partial tokens becomes U+FFFD, as in `tokenizers`).
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const = 0;

  virtual int64_t vocab_size() const = 0;  // largest id + 1, added tokens included
  virtual std::optional<int64_t> token_to_id(const std::string& token) const = 0;
  virtual std::string id_to_token(int64_t id) const = 0;
  virtual bool is_special(int64_t id) const = 0;
  // An upper bound on the bytes of text one token stands for (its longest piece, times what the
  // normalizer can shrink a text by): a text of more than n times this many bytes has more than
  // n tokens, so a caller can refuse it without encoding it. 0: no bound known (SentencePiece,
  // whose unknown pieces may span several characters).
  virtual int64_t max_bytes_per_token() const { return 0; }

  // From tokenizer_config.json (bos_token, eos_token, pad_token) when present.
  std::optional<int64_t> bos_id, eos_id, pad_id;
};

// Loads DIR/tokenizer.json, else DIR/tokenizer.model; reads DIR/tokenizer_config.json for the
// bos/eos/pad tokens. Throws ConfigError/IoError naming the file and key.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir);

// The ids that end a completion: config.json's eos_token_id, generation_config.json's and the
// tokenizer's eos token, sorted and unique. ConfigError names a generation_config.json that is not JSON.
std::vector<int64_t> eos_token_ids(const std::string& dir, const model::ModelConfig& cfg, const Tokenizer& tok);

// Parses a tokenizer.json document (`where` names it in errors).
std::unique_ptr<Tokenizer> make_bpe_tokenizer(const std::string& json_text, const std::string& where);
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path);

}  // namespace tiller::text
