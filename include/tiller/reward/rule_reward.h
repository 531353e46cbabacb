// Rule rewards: a score computed from a sample's text (and its dataset label) without a model.
//
// A process-wide registry maps names to functions. Built in:
//   "math_answer"  1 when the response's final answer equals the label's: the number after the
//                  last "####", else the contents of the last \boxed{...} (nested braces allowed);
//                  numbers compare by value ("1,000" = "1000.0"), anything else as trimmed text.
//                  The label may be a bare answer or carry its own "####" / \boxed{}.
//   "exact_match"  1 when the trimmed response equals the trimmed label.
//   "toy_digits"   the share of the response's characters that are ASCII digits (the quickstart's
//                  toy task: a random tiny model starts near 0 and learns it in a few minutes on CPU)
//   "toy_echo"     the share of the label's characters the response repeats from its start
//   "regex:<re>"   1 when the whole response matches the ECMAScript regular expression <re>
//                  (a format reward, e.g. "regex:(?:.|\n)*#### -?[0-9]+\s*").
// Library users add their own before the job starts (docs/library.md):
//   tiller::reward::register_fn("my_reward", [](const tiller::reward::Sample& s) { return score(s.response_text); });
//
// Threading: register before the job starts; find() and the functions it returns may then be
// called from any thread. The built-ins are pure.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace tiller::reward {

struct Sample {
  std::string prompt_text;
  std::string response_text;
  std::string label;  // the dataset's label ("" when it has none)
};

using RewardFn = std::function<double(const Sample&)>;

// Adds `fn` under `name`. ConfigError when the name is empty, taken, or starts with "regex:".
void register_fn(const std::string& name, RewardFn fn);
// The function for `spec` (a registered name, or "regex:<re>"). ConfigError names the spec and
// lists the registered names, or says what is wrong with the regular expression.
RewardFn find(const std::string& spec);
std::vector<std::string> names();  // sorted, built-ins included

// The final answer of a text as "math_answer" reads it, or nullopt when there is none.
std::optional<std::string> extract_answer(const std::string& text);
// Whether two answers are equal as "math_answer" compares them.
bool answers_match(const std::string& a, const std::string& b);

}  // namespace tiller::reward
