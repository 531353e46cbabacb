// SentencePiece models (tokenizer.model) through libsentencepiece. Control symbols written in
// the text (e.g. "<s>") are recognised and become their ids, the way transformers' slow
// tokenizers treat special tokens; the text between them is encoded by SentencePiece.
#include <sentencepiece_processor.h>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/text/tokenizer.h"

namespace tiller::text {
namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (!status.ok()) throw IoError(fmt::format("{}: cannot load the SentencePiece model: {}", path, status.ToString()));
    for (int i = 0; i < sp_.GetPieceSize(); ++i) {
      if (sp_.IsControl(i)) {  // user-defined symbols SentencePiece matches itself
        const std::string piece = sp_.IdToPiece(i);
        if (!piece.empty()) specials_.push_back({piece, i});
      }
    }
    // Longest first, so "<|a|b|>" wins over a prefix "<|a|>".
    std::sort(specials_.begin(), specials_.end(),
              [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    if (sp_.bos_id() >= 0) bos_id = sp_.bos_id();
    if (sp_.eos_id() >= 0) eos_id = sp_.eos_id();
    if (sp_.pad_id() >= 0) pad_id = sp_.pad_id();
  }

  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens) const override {
    std::vector<int64_t> ids;
    if (add_special_tokens && sp_.bos_id() >= 0) ids.push_back(sp_.bos_id());
    size_t start = 0, pos = 0;
    auto flush = [&](size_t end) {
      if (end <= start) return;
      std::vector<int> part;
      const auto status = sp_.Encode(text.substr(start, end - start), &part);
      if (!status.ok()) throw ConfigError(fmt::format("{}: cannot encode: {}", path_, status.ToString()));
      ids.insert(ids.end(), part.begin(), part.end());
    };
    while (pos < text.size()) {
      const std::pair<std::string, int>* hit = nullptr;
      for (const auto& s : specials_)
        if (text.compare(pos, s.first.size(), s.first) == 0) {
          hit = &s;
          break;
        }
      if (!hit) {
        ++pos;
        continue;
      }
      flush(pos);
      ids.push_back(hit->second);
      pos += hit->first.size();
      start = pos;
    }
    flush(text.size());
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::vector<int> keep;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size())
        throw ConfigError(fmt::format("decode: token id {} is outside the vocabulary [0, {})", id, vocab_size()));
      if (skip_special_tokens && is_special(id)) continue;
      keep.push_back(static_cast<int>(id));
    }
    std::string out;
    const auto status = sp_.Decode(keep, &out);
    if (!status.ok()) throw ConfigError(fmt::format("{}: cannot decode: {}", path_, status.ToString()));
    return out;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int64_t> token_to_id(const std::string& token) const override {
    const int id = sp_.PieceToId(token);
    if (id == sp_.unk_id() && token != sp_.IdToPiece(sp_.unk_id())) return std::nullopt;
    return id;
  }
  std::string id_to_token(int64_t id) const override {
    TILLER_CHECK(id >= 0 && id < vocab_size(), "token id {} is outside the vocabulary", id);
    return sp_.IdToPiece(static_cast<int>(id));
  }
  bool is_special(int64_t id) const override {
    return id >= 0 && id < vocab_size() && (sp_.IsControl(static_cast<int>(id)) || sp_.IsUnknown(static_cast<int>(id)));
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  std::vector<std::pair<std::string, int>> specials_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path) {
  return std::make_unique<SentencePieceTokenizer>(model_path);
}

}  // namespace tiller::text
