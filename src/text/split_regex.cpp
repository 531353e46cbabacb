// PCRE2 with Unicode properties on (\p{L}, \s over Unicode, ...).
#include "text/split_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>

#include <fmt/format.h>

#include "text/utf8.h"
#include "tiller/core/error.h"

namespace tiller::text {
namespace {

// `tokenizers` runs its patterns through Oniguruma, whose \s is exactly \t \n \v \f \r, U+0085
// and the Z categories. PCRE2's \s also takes its horizontal-space list (U+180E, the Mongolian
// vowel separator, is Cf today), so \s and \S are spelled out. \S inside a class has no such
// spelling and is refused.
std::string oniguruma_spaces(const std::string& pattern, const std::string& where) {
  static const std::string kSpace = R"(\t\n\x0B\f\r\x{85}\p{Z})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char n = pattern[++i];
      if (n == 's') out += in_class ? kSpace : "[" + kSpace + "]";
      else if (n == 'S' && !in_class) out += "[^" + kSpace + "]";
      else if (n == 'S') throw ConfigError(fmt::format("{}: regex /{}/ uses \\S inside a character class", where, pattern));
      else out += std::string{c, n};
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];  // a literal ] first
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& source, const std::string& where) {
  const std::string pattern = oniguruma_spaces(source, where);
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                                   &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw ConfigError(fmt::format("{}: regex /{}/ does not compile at offset {}: {}", where, source, off,
                                  reinterpret_cast<const char*>(msg)));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when JIT is unavailable
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::vector<std::pair<size_t, size_t>> Regex::find_all(const std::string& s) const {
  auto* code = static_cast<pcre2_code*>(code_);
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  size_t pos = 0;
  uint32_t options = 0;
  while (pos <= s.size()) {
    // The subject's UTF-8 is checked once: PCRE2 would check all of it again on every call,
    // which made splitting a long text quadratic in its length.
    const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, options, md, nullptr);
    options = PCRE2_NO_UTF_CHECK;
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[1] == ov[0]) {  // empty match: step over one character
      pos = ov[0] + std::max<size_t>(1, utf8::char_len(s, ov[0]));
      continue;
    }
    out.emplace_back(ov[0], ov[1]);
    pos = ov[1];
  }
  pcre2_match_data_free(md);
  return out;
}

Behavior parse_behavior(const std::string& b, const std::string& where) {
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  throw ConfigError(fmt::format("{}: split behavior '{}' is unknown", where, b));
}

std::vector<std::string> split_by(const std::string& s, const std::vector<std::pair<size_t, size_t>>& matches,
                                  Behavior behavior, bool invert) {
  struct Span {
    size_t b, e;
    bool match;
  };
  std::vector<Span> spans;
  size_t prev = 0;
  for (auto [b, e] : matches) {
    if (b > prev) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }
  if (prev < s.size()) spans.push_back({prev, s.size(), invert});
  std::vector<std::string> out;
  auto text = [&](const Span& sp) { return s.substr(sp.b, sp.e - sp.b); };
  switch (behavior) {
    case Behavior::kRemoved:
      for (const auto& sp : spans)
        if (!sp.match) out.push_back(text(sp));
      break;
    case Behavior::kIsolated:
      for (const auto& sp : spans) out.push_back(text(sp));
      break;
    case Behavior::kMergedWithPrevious: {
      bool prev_ok = false;
      for (const auto& sp : spans) {
        if (sp.match && prev_ok) out.back() += text(sp);
        else out.push_back(text(sp));
        prev_ok = !sp.match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool pending = false;
      for (const auto& sp : spans) {
        if (pending) out.back() += text(sp);
        else out.push_back(text(sp));
        pending = sp.match;
      }
      break;
    }
    case Behavior::kContiguous: {
      bool last_match = false;
      for (const auto& sp : spans) {
        if (sp.match && last_match) out.back() += text(sp);
        else out.push_back(text(sp));
        last_match = sp.match;
      }
      break;
    }
  }
  out.erase(std::remove_if(out.begin(), out.end(), [](const std::string& x) { return x.empty(); }), out.end());
  return out;
}

}  // namespace tiller::text
