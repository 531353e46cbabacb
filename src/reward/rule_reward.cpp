#include "tiller/reward/rule_reward.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <regex>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/registry.h"

namespace tiller::reward {
namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// A number written the usual ways: commas between digits, a leading '$', a trailing '.' or '%'.
std::optional<double> as_number(std::string s) {
  s = trim(s);
  std::string t;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == ',') {  // only as a thousands separator: a digit before, exactly three after
      auto digit = [&](size_t j) { return j < s.size() && std::isdigit(static_cast<unsigned char>(s[j])); };
      if (i == 0 || !digit(i - 1) || !digit(i + 1) || !digit(i + 2) || !digit(i + 3) || digit(i + 4))
        return std::nullopt;
      continue;
    }
    if (c == '$' && t.empty()) continue;
    t += c;
  }
  while (!t.empty() && (t.back() == '.' || t.back() == '%')) t.pop_back();
  if (t.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// The registry, the built-ins added on first use (through the same call as a user's).
Registry<RewardFn>& registry() {
  static Registry<RewardFn>* r = [] {
    auto* reg = new Registry<RewardFn>("rule reward", [](const RewardFn& fn) { return fn ? "" : "no function"; });
    reg->add("math_answer", [](const Sample& s) {
      const auto got = extract_answer(s.response_text);
      if (!got) return 0.0;
      const auto want = extract_answer(s.label);
      return answers_match(*got, want ? *want : s.label) ? 1.0 : 0.0;
    });
    reg->add("exact_match", [](const Sample& s) { return trim(s.response_text) == trim(s.label) ? 1.0 : 0.0; });
    // The quickstart's toy tasks: a random tiny model starts near 0 and learns them in minutes.
    reg->add("toy_digits", [](const Sample& s) {
      int64_t digits = 0, chars = 0;
      for (unsigned char c : s.response_text) {
        if ((c & 0xc0) == 0x80) continue;  // UTF-8 continuation bytes: one character each
        ++chars;
        if (c >= '0' && c <= '9') ++digits;
      }
      return chars == 0 ? 0.0 : static_cast<double>(digits) / static_cast<double>(chars);
    });
    reg->add("toy_echo", [](const Sample& s) {
      // Share of the label's characters that the response repeats, in order, from its start.
      const std::string want = trim(s.label), got = trim(s.response_text);
      if (want.empty()) return 0.0;
      size_t i = 0;
      while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
      return static_cast<double>(i) / static_cast<double>(want.size());
    });
    return reg;
  }();
  return *r;
}

}  // namespace

std::optional<std::string> extract_answer(const std::string& text) {
  const auto hashes = text.rfind("####");
  if (hashes != std::string::npos) {
    std::string rest = trim(text.substr(hashes + 4));
    const auto eol = rest.find('\n');
    if (eol != std::string::npos) rest = trim(rest.substr(0, eol));
    if (!rest.empty()) return rest;
  }
  const auto boxed = text.rfind("\\boxed{");
  if (boxed != std::string::npos) {
    int depth = 1;
    const size_t start = boxed + 7;
    for (size_t i = start; i < text.size(); ++i) {
      if (text[i] == '{') ++depth;
      if (text[i] == '}' && --depth == 0) return trim(text.substr(start, i - start));
    }
  }
  return std::nullopt;
}

bool answers_match(const std::string& a, const std::string& b) {
  const auto x = as_number(a), y = as_number(b);
  if (x && y) return std::fabs(*x - *y) <= 1e-6 * std::max(1.0, std::fabs(*y));
  return trim(a) == trim(b);
}

TILLER_REGISTRY_DEFINE(rule_reward, RewardFn, registry, "reward.rule")

RewardFn rule_reward_for(const std::string& spec) {
  if (spec.rfind("regex:", 0) == 0) {
    const std::string pattern = spec.substr(6);
    std::shared_ptr<const std::regex> re;
    try {
      re = std::make_shared<const std::regex>(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw ConfigError(fmt::format("reward.rule = '{}': not a valid regular expression: {}", spec, e.what()));
    }
    return [re](const Sample& s) { return std::regex_match(s.response_text, *re) ? 1.0 : 0.0; };
  }
  return find_rule_reward(spec);
}

}  // namespace tiller::reward
