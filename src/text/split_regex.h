// Regexes and splits of the `tokenizers` pre-tokenizers (private to src/model): PCRE2 patterns with
// Oniguruma's \s, and the Split pre-tokenizer's behaviors. PCRE2 stays inside split_regex.cpp.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tiller::text {

class Regex {
 public:
  // `where` names the file and key for the ConfigError of a pattern that does not compile.
  Regex(const std::string& source, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Non-overlapping matches [begin, end) left to right.
  std::vector<std::pair<size_t, size_t>> find_all(const std::string& s) const;

 private:
  void* code_ = nullptr;  // pcre2_code
};

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior parse_behavior(const std::string& b, const std::string& where);

// Splits `s` by the matches of a regex according to `behavior` (the `tokenizers` semantics).
std::vector<std::string> split_by(const std::string& s, const std::vector<std::pair<size_t, size_t>>& matches,
                                  Behavior behavior, bool invert);

}  // namespace tiller::text
