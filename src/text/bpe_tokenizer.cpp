// Byte-level BPE from a Hugging Face tokenizer.json, following the `tokenizers` pipeline:
// added tokens split out -> normalizer -> pre-tokenizer -> BPE model -> post-processor.
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <functional>
#include <map>
#include <queue>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "text/split_regex.h"
#include "text/utf8.h"
#include "tiller/core/error.h"
#include "tiller/text/tokenizer.h"

namespace tiller::text {
namespace {

using nlohmann::json;

// --- byte <-> character map of GPT-2's byte-level BPE ------------------------------------------
struct ByteMap {
  std::string byte_to_text[256];
  std::unordered_map<uint32_t, uint8_t> char_to_byte;
  ByteMap() {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      byte_to_text[b] = utf8::encode(cp);
      char_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// Token ids are below this (the largest published vocabularies have ~2^18 tokens): a file with an
// id of 10^12 is refused, not allocated for, and pair keys hold two ids in 64 bits.
constexpr int64_t kMaxVocab = int64_t{1} << 26;

// The pre-tokenizer of GPT-2 (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct PreTokenizerStep {
  enum Kind { kByteLevel, kSplit } kind = kSplit;
  bool add_prefix_space = false;
  std::shared_ptr<Regex> regex;  // ByteLevel with use_regex, or Split
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
};

struct AddedToken {
  int64_t id;
  std::string content;
  bool special, single_word, lstrip, rstrip, normalized;
};

// A piece of input: plain text, or an added token already identified.
struct Segment {
  std::string text;
  int64_t added_id = -1;
};

// Rust's char::is_alphanumeric() || '_' and char::is_whitespace(), which `tokenizers` uses for
// single_word and lstrip/rstrip, by Unicode category.
bool is_word_char(uint32_t cp) {
  if (cp == '_') return true;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}
bool is_space_char(uint32_t cp) {
  if ((cp >= 9 && cp <= 13) || cp == 0x85) return true;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}
// The character ending just before byte `i` of s, and where it starts.
uint32_t char_before(const std::string& s, size_t i, size_t* start) {
  size_t b = i - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  uint32_t cp = 0xFFFD;
  if (utf8::decode(s, b, &cp) != i - b) cp = 0xFFFD;
  *start = b;
  return cp;
}
uint32_t char_at(const std::string& s, size_t i, size_t* len) {
  uint32_t cp = 0xFFFD;
  *len = utf8::decode(s, i, &cp);
  if (*len == 0) {
    *len = 1;
    cp = 0xFFFD;
  }
  return cp;
}

class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(const json& j, const std::string& where) : where_(where) {
    load_model(j.at("model"));
    load_added(j.value("added_tokens", json::array()));
    load_normalizer(j.contains("normalizer") ? j["normalizer"] : json());
    load_pre_tokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json(), "pre_tokenizer");
    load_post_processor(j.contains("post_processor") ? j["post_processor"] : json(), "post_processor");
    load_decoder(j.contains("decoder") ? j["decoder"] : json(), "decoder");
  }

  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens) const override {
    std::vector<int64_t> ids;
    for (const Segment& raw : split_added(text, /*normalized=*/false)) {
      if (raw.added_id >= 0) {
        ids.push_back(raw.added_id);
        continue;
      }
      for (const Segment& seg : split_added(normalize(raw.text), /*normalized=*/true)) {
        if (seg.added_id >= 0) {
          ids.push_back(seg.added_id);
          continue;
        }
        for (const std::string& word : pre_tokenize(seg.text)) bpe(word, ids);
      }
    }
    if (add_special_tokens && !template_.empty()) {
      std::vector<int64_t> out;
      for (const auto& item : template_) {
        if (item.empty()) out.insert(out.end(), ids.begin(), ids.end());
        else out.insert(out.end(), item.begin(), item.end());
      }
      return out;
    }
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::string bytes;
    const auto& bm = byte_map();
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size()) throw ConfigError(fmt::format("decode: token id {} is outside the vocabulary [0, {})", id, vocab_size()));
      if (skip_special_tokens && is_special(id)) continue;
      const std::string& tok = id_to_token_[id];
      if (!byte_level_decoder_) {
        bytes += tok;
        continue;
      }
      // Every character must be a mapped byte; otherwise the token's own bytes are used.
      std::string mapped;
      bool all = true;
      for (size_t i = 0; i < tok.size() && all;) {
        uint32_t cp = 0;
        const size_t n = utf8::decode(tok, i, &cp);
        auto it = bm.char_to_byte.find(cp);
        if (n == 0 || it == bm.char_to_byte.end()) all = false;
        else mapped.push_back(static_cast<char>(it->second));
        i += std::max<size_t>(n, 1);
      }
      bytes += all ? mapped : tok;
    }
    return utf8::lossy(bytes);
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::optional<int64_t> token_to_id(const std::string& token) const override {
    for (const auto& a : added_)
      if (a.content == token) return a.id;
    auto it = vocab_.find(token);
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  std::string id_to_token(int64_t id) const override {
    TILLER_CHECK(id >= 0 && id < vocab_size(), "token id {} is outside the vocabulary", id);
    return id_to_token_[id];
  }
  bool is_special(int64_t id) const override { return special_ids_.count(id) > 0; }
  int64_t max_bytes_per_token() const override {
    // A vocabulary entry is at least as long in UTF-8 as the bytes it stands for (byte-level
    // entries spell each byte with one or two characters). Unicode normalization can shrink a
    // text (composition: three jamo of 9 bytes become one syllable of 3), hence the factor 4.
    int64_t longest = 4;  // the unknown token stands for one character
    for (const std::string& t : id_to_token_) longest = std::max<int64_t>(longest, static_cast<int64_t>(t.size()));
    return normalizers_.empty() ? longest : 4 * longest;
  }

 private:
  [[noreturn]] void unsupported(const std::string& key, const std::string& what) const {
    throw ConfigError(fmt::format("{}: {} {} is not supported by tiller's byte-level BPE tokenizer", where_, key, what));
  }

  void load_model(const json& m) {
    const std::string type = m.value("type", "BPE");
    if (type != "BPE") unsupported("model.type", "'" + type + "'");
    if (m.value("byte_fallback", false))
      unsupported("model.byte_fallback", "true (a SentencePiece-style BPE; use its tokenizer.model)");
    if (m.contains("continuing_subword_prefix") && !m["continuing_subword_prefix"].is_null() &&
        !m["continuing_subword_prefix"].get<std::string>().empty())
      unsupported("model.continuing_subword_prefix", "");
    if (m.contains("end_of_word_suffix") && !m["end_of_word_suffix"].is_null() &&
        !m["end_of_word_suffix"].get<std::string>().empty())
      unsupported("model.end_of_word_suffix", "");
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
      unsupported("model.dropout", "(BPE dropout)");
    ignore_merges_ = m.value("ignore_merges", false);
    if (!m.contains("vocab") || !m["vocab"].is_object()) throw ConfigError(fmt::format("{}: model.vocab is missing", where_));
    int64_t max_id = -1;
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      const int64_t id = it.value().get<int64_t>();
      if (id < 0 || id >= kMaxVocab)
        throw ConfigError(fmt::format("{}: model.vocab['{}'] has id {}, outside [0, {})", where_, it.key(), id, kMaxVocab));
      vocab_[it.key()] = id;
      max_id = std::max(max_id, id);
    }
    id_to_token_.assign(max_id + 1, "");
    for (const auto& [tok, id] : vocab_) id_to_token_[id] = tok;
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = vocab_.find(m["unk_token"].get<std::string>());
      if (it != vocab_.end()) unk_id_ = it->second;
    }
    const json& merges = m.value("merges", json::array());
    for (size_t r = 0; r < merges.size(); ++r) {
      std::string a, b;
      if (merges[r].is_string()) {
        const std::string s = merges[r].get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          throw ConfigError(fmt::format("{}: model.merges[{}] '{}' is not two tokens", where_, r, s));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (merges[r].is_array() && merges[r].size() == 2) {
        a = merges[r][0].get<std::string>();
        b = merges[r][1].get<std::string>();
      } else {
        throw ConfigError(fmt::format("{}: model.merges[{}] is neither \"a b\" nor [a, b]", where_, r));
      }
      auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end())
        throw ConfigError(fmt::format("{}: model.merges[{}] ('{}' '{}') uses a token missing from model.vocab", where_, r, a, b));
      merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(static_cast<int64_t>(r), iab->second));
    }
  }

  void load_added(const json& arr) {
    for (const auto& a : arr) {
      AddedToken t{a.at("id").get<int64_t>(), a.at("content").get<std::string>(), a.value("special", false),
                   a.value("single_word", false), a.value("lstrip", false), a.value("rstrip", false),
                   a.value("normalized", false)};
      if (t.content.empty()) throw ConfigError(fmt::format("{}: added token {} has empty content", where_, t.id));
      if (t.id < 0 || t.id >= kMaxVocab)
        throw ConfigError(fmt::format("{}: added token '{}' has id {}, outside [0, {})", where_, t.content, t.id, kMaxVocab));
      added_first_byte_[static_cast<unsigned char>(t.content[0])] = true;
      if (t.id >= static_cast<int64_t>(id_to_token_.size())) id_to_token_.resize(t.id + 1);
      id_to_token_[t.id] = t.content;
      if (t.special) special_ids_.insert({t.id, true});
      added_.push_back(t);
    }
  }

  void load_normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = n.value("type", "");
    if (type == "Sequence") {
      for (const auto& s : n.at("normalizers")) load_normalizer(s);
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
      normalizers_.push_back(type);
    } else {
      unsupported("normalizer", "'" + type + "'");
    }
  }

  void load_pre_tokenizer(const json& p, const std::string& key) {
    if (p.is_null()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      const auto& list = p.at("pretokenizers");
      for (size_t i = 0; i < list.size(); ++i) load_pre_tokenizer(list[i], fmt::format("{}.pretokenizers[{}]", key, i));
    } else if (type == "ByteLevel") {
      PreTokenizerStep s;
      s.kind = PreTokenizerStep::kByteLevel;
      s.add_prefix_space = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) s.regex = std::make_shared<Regex>(kGpt2Pattern, where_);
      steps_.push_back(s);
    } else if (type == "Split") {
      PreTokenizerStep s;
      s.kind = PreTokenizerStep::kSplit;
      const json& pat = p.at("pattern");
      if (pat.contains("Regex")) {
        s.regex = std::make_shared<Regex>(pat["Regex"].get<std::string>(), where_ + " " + key);
      } else if (pat.contains("String")) {
        s.regex = std::make_shared<Regex>(quote_meta(pat["String"].get<std::string>()), where_ + " " + key);
      } else {
        throw ConfigError(fmt::format("{}: {}.pattern needs Regex or String", where_, key));
      }
      s.behavior = parse_behavior(p.value("behavior", "Isolated"), where_ + " " + key);
      s.invert = p.value("invert", false);
      steps_.push_back(s);
    } else if (type == "Digits") {
      PreTokenizerStep s;
      s.kind = PreTokenizerStep::kSplit;
      const bool individual = p.value("individual_digits", false);
      s.regex = std::make_shared<Regex>(individual ? R"(\p{N})" : R"(\p{N}+)", where_);
      s.behavior = Behavior::kIsolated;
      steps_.push_back(s);
    } else {
      unsupported(key, "'" + type + "'");
    }
  }

  void load_post_processor(const json& p, const std::string& key) {
    if (p.is_null()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      const auto& list = p.at("processors");
      for (size_t i = 0; i < list.size(); ++i) load_post_processor(list[i], fmt::format("{}.processors[{}]", key, i));
    } else if (type == "ByteLevel") {
      // Only adjusts offsets; ids are unchanged.
    } else if (type == "TemplateProcessing") {
      const json& specials = p.value("special_tokens", json::object());
      for (const auto& item : p.at("single")) {
        if (item.contains("Sequence")) {
          template_.push_back({});
        } else if (item.contains("SpecialToken")) {
          const std::string name = item["SpecialToken"].at("id").get<std::string>();
          if (!specials.contains(name)) throw ConfigError(fmt::format("{}: {} names special token '{}' it does not define", where_, key, name));
          auto ids = specials[name].at("ids").get<std::vector<int64_t>>();
          if (ids.empty()) continue;
          template_.push_back(ids);
        }
      }
    } else {
      unsupported(key, "'" + type + "'");
    }
  }

  void load_decoder(const json& d, const std::string& key) {
    if (d.is_null()) return;
    const std::string type = d.value("type", "");
    if (type == "ByteLevel") byte_level_decoder_ = true;
    else if (type == "Sequence" && d.contains("decoders") && d["decoders"].size() == 1) load_decoder(d["decoders"][0], key);
    else unsupported(key, "'" + type + "'");
  }

  // A literal for PCRE2: ASCII punctuation escaped one by one (no \Q..\E, which the \s rewrite
  // would not respect).
  static std::string quote_meta(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) out += '\\';
      out += c;
    }
    return out;
  }
  static uint64_t pair_key(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b); }

  std::string normalize(const std::string& s) const {
    std::string out = s;
    for (const auto& n : normalizers_) {
      const auto* in = reinterpret_cast<const utf8proc_uint8_t*>(out.c_str());
      utf8proc_uint8_t* r = n == "NFC" ? utf8proc_NFC(in) : n == "NFD" ? utf8proc_NFD(in) : n == "NFKC" ? utf8proc_NFKC(in) : utf8proc_NFKD(in);
      if (!r) throw ConfigError(fmt::format("{}: {} normalization failed (input is not valid UTF-8)", where_, n));
      out.assign(reinterpret_cast<const char*>(r));
      std::free(r);
    }
    return out;
  }

  // Leftmost-longest matches of the added tokens whose `normalized` flag equals `normalized`.
  std::vector<Segment> split_added(const std::string& text, bool normalized) const {
    std::vector<Segment> out;
    size_t start = 0, pos = 0;
    while (pos < text.size()) {
      const AddedToken* best = nullptr;
      if (!added_first_byte_[static_cast<unsigned char>(text[pos])]) {  // no added token starts here
        ++pos;
        continue;
      }
      for (const auto& a : added_) {
        if (a.normalized != normalized || a.content.size() > text.size() - pos) continue;
        if ((!best || a.content.size() > best->content.size()) && text.compare(pos, a.content.size(), a.content) == 0) {
          if (a.single_word) {
            const size_t e = pos + a.content.size();
            size_t at = 0;
            if (pos > 0 && is_word_char(char_before(text, pos, &at))) continue;
            if (e < text.size() && is_word_char(char_at(text, e, &at))) continue;
          }
          best = &a;
        }
      }
      if (!best) {
        pos += std::max<size_t>(1, utf8::char_len(text, pos));
        continue;
      }
      size_t b = pos, e = pos + best->content.size();
      size_t at = 0;
      if (best->lstrip)
        while (b > start && is_space_char(char_before(text, b, &at))) b = at;
      if (best->rstrip)
        while (e < text.size() && is_space_char(char_at(text, e, &at))) e += at;
      if (b > start) out.push_back({text.substr(start, b - start), -1});
      out.push_back({"", best->id});
      start = pos = e;
    }
    if (start < text.size()) out.push_back({text.substr(start), -1});
    return out;
  }

  std::vector<std::string> pre_tokenize(const std::string& text) const {
    std::vector<std::string> pieces{text};
    for (const auto& step : steps_) {
      std::vector<std::string> next;
      for (std::string piece : pieces) {
        if (step.kind == PreTokenizerStep::kByteLevel) {
          if (step.add_prefix_space && piece.rfind(' ', 0) != 0) piece = " " + piece;
          std::vector<std::string> words{piece};
          if (step.regex) words = split_by(piece, step.regex->find_all(piece), Behavior::kIsolated, false);
          for (const auto& w : words) {
            std::string mapped;
            for (unsigned char c : w) mapped += byte_map().byte_to_text[c];
            next.push_back(std::move(mapped));
          }
        } else {
          for (auto& w : split_by(piece, step.regex->find_all(piece), step.behavior, step.invert)) next.push_back(std::move(w));
        }
      }
      pieces = std::move(next);
    }
    return pieces;
  }

  void bpe(const std::string& word, std::vector<int64_t>& ids) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      auto it = vocab_.find(word);
      if (it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    // The symbols as a linked list over their first characters' slots.
    struct Symbol {
      int64_t id;
      int64_t prev, next;  // -1 at the ends
    };
    std::vector<Symbol> sym;
    for (size_t i = 0; i < word.size();) {
      const size_t n = std::max<size_t>(1, utf8::char_len(word, i));
      auto it = vocab_.find(word.substr(i, n));
      const int64_t id = it != vocab_.end() ? it->second : unk_id_;
      if (id >= 0) {
        const auto k = static_cast<int64_t>(sym.size());
        sym.push_back({id, k - 1, -1});
        if (k > 0) sym[static_cast<size_t>(k - 1)].next = k;
      }
      i += n;
    }
    // Merge the lowest-ranked adjacent pair (leftmost on ties) until none applies, as `tokenizers`
    // does: candidates in a min-heap by (rank, slot), O(n log n) in the word's length. A candidate
    // is stale once either symbol has merged into a longer one; its ids then differ, since a
    // symbol's text only grows and ids name texts.
    struct Candidate {
      int64_t rank, slot, left, right, merged;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : slot > o.slot; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
    auto offer = [&](int64_t slot) {
      if (slot < 0) return;
      const Symbol& a = sym[static_cast<size_t>(slot)];
      if (a.next < 0) return;
      const int64_t right = sym[static_cast<size_t>(a.next)].id;
      auto it = merges_.find(pair_key(a.id, right));
      if (it != merges_.end()) heap.push({it->second.first, slot, a.id, right, it->second.second});
    };
    for (int64_t k = 0; k + 1 < static_cast<int64_t>(sym.size()); ++k) offer(k);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      Symbol& a = sym[static_cast<size_t>(c.slot)];
      if (a.id != c.left || a.next < 0 || sym[static_cast<size_t>(a.next)].id != c.right) continue;
      Symbol& b = sym[static_cast<size_t>(a.next)];
      a.id = c.merged;
      b.id = -1;
      a.next = b.next;
      if (b.next >= 0) sym[static_cast<size_t>(b.next)].prev = c.slot;
      offer(a.prev);
      offer(c.slot);
    }
    for (int64_t k = sym.empty() ? -1 : 0; k >= 0; k = sym[static_cast<size_t>(k)].next)
      ids.push_back(sym[static_cast<size_t>(k)].id);
  }

  std::string where_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> merges_;  // pair -> (rank, merged id)
  bool ignore_merges_ = false;
  int64_t unk_id_ = -1;
  std::vector<AddedToken> added_;
  std::array<bool, 256> added_first_byte_{};  // bytes that some added token starts with
  std::map<int64_t, bool> special_ids_;
  std::vector<std::string> normalizers_;
  std::vector<PreTokenizerStep> steps_;
  std::vector<std::vector<int64_t>> template_;  // an empty entry stands for the sequence itself
  bool byte_level_decoder_ = false;
};

}  // namespace

std::unique_ptr<Tokenizer> make_bpe_tokenizer(const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("{}: not valid JSON ({})", where, e.what()));
  }
  try {
    return std::make_unique<BpeTokenizer>(j, where);
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("{}: unexpected structure ({})", where, e.what()));
  }
}

}  // namespace tiller::text
