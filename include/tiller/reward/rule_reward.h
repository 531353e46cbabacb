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
//   tiller::reward::register_rule_reward("my_reward", [](const tiller::reward::Sample& s) { return score(s.response_text); });
//
// The registry is a tiller::Registry (tiller/core/registry.h): names of 1 to 64 of [a-z0-9_.-]
// (so none starts with "regex:"), each registered once. Threading: register before the job
// starts; the lookups and the functions they return may then be called from any thread. The
// built-ins are pure.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tiller/core/registry_api.h"

namespace tiller::reward {

struct Sample {
  std::string prompt_text;
  std::string response_text;
  std::string label;  // the dataset's label ("" when it has none)
};

using RewardFn = std::function<double(const Sample&)>;

// register_rule_reward(name, fn), find_rule_reward(name) (a ConfigError naming reward.rule, the
// registered names and the closest one when it is missing) and rule_reward_names() (sorted,
// built-ins included).
TILLER_REGISTRY_API(rule_reward, RewardFn);
// The function for a reward.rule `spec`: a registered name, or "regex:<re>". ConfigError as
// find_rule_reward's, or saying what is wrong with the regular expression.
RewardFn rule_reward_for(const std::string& spec);

// The names before the registry scheme, for one release.
inline void register_fn(const std::string& name, RewardFn fn) { register_rule_reward(name, std::move(fn)); }
inline RewardFn find(const std::string& spec) { return rule_reward_for(spec); }
inline std::vector<std::string> names() { return rule_reward_names(); }

// The final answer of a text as "math_answer" reads it, or nullopt when there is none.
std::optional<std::string> extract_answer(const std::string& text);
// Whether two answers are equal as "math_answer" compares them.
bool answers_match(const std::string& a, const std::string& b);

}  // namespace tiller::reward
