#include "tiller/controller/step_hooks.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "controller/hook_runner.h"
#include "tiller/core/error.h"
#include "tiller/core/registry.h"

namespace tiller::controller {
namespace {

Registry<StepHookDef>& hooks() {
  static Registry<StepHookDef>* r = new Registry<StepHookDef>("step hook", [](const StepHookDef& d) {
    return d.after_scoring || d.step_end || d.checkpoint ? "" : "no function (after_scoring, step_end or checkpoint)";
  });
  return *r;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

TILLER_REGISTRY_DEFINE(step_hook, StepHookDef, hooks, "train.step_hooks")

std::vector<std::pair<std::string, const StepHookDef*>> parse_step_hooks(const std::string& list) {
  std::vector<std::pair<std::string, const StepHookDef*>> out;
  if (trim(list).empty()) return out;
  size_t begin = 0;
  for (;;) {
    const size_t comma = list.find(',', begin);
    const std::string name = trim(list.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
    if (name.empty())
      throw ConfigError(fmt::format("train.step_hooks = '{}': an empty name; give registered names separated by commas",
                                    list));
    if (std::any_of(out.begin(), out.end(), [&](const auto& h) { return h.first == name; }))
      throw ConfigError(fmt::format("train.step_hooks = '{}': '{}' is named twice; name each hook once", list, name));
    out.emplace_back(name, &find_step_hook(name));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

}  // namespace tiller::controller

// --- the controller's runner (src/controller/hook_runner.h) ---

namespace tiller::controller {
namespace {

template <typename F>
void call(const std::string& name, const char* point, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    throw Error(fmt::format("step hook '{}' ({}): {}", name, point, e.what()));
  }
}

}  // namespace

StepHookRunner::StepHookRunner(const std::string& list) : hooks_(parse_step_hooks(list)) {}

bool StepHookRunner::has_after_scoring() const {
  return std::any_of(hooks_.begin(), hooks_.end(), [](const auto& h) { return static_cast<bool>(h.second->after_scoring); });
}

std::vector<uint8_t> StepHookRunner::after_scoring(
    int64_t step, int64_t n_samples, Rollout& ro, int64_t groups,
    const std::function<const data::Prompt&(int64_t group)>& prompt,
    const std::function<std::string(const std::vector<int64_t>&)>& decode) const {
  std::vector<uint8_t> keep(static_cast<size_t>(groups), 1);
  ScoredStep ss;
  ss.step = step;
  ss.n_samples = n_samples;
  ss.rollout = &ro;
  ss.keep_group = &keep;
  ss.prompt = [&](int64_t g) -> const data::Prompt& {
    TILLER_CHECK(g >= 0 && g < groups, "prompt group {} of a step of {}", g, groups);
    return prompt(g);
  };
  ss.response_text = [&](int64_t s) {
    TILLER_CHECK(s >= 0 && s < ro.size(), "sample {} of a step of {}", s, ro.size());
    return decode ? decode(ro.response_ids(s)) : std::string();
  };
  const int64_t samples = ro.size();
  for (const auto& [name, h] : hooks_) {
    if (!h->after_scoring) continue;
    call(name, "after_scoring", [&] { h->after_scoring(ss); });
    if (ro.size() != samples || static_cast<int64_t>(keep.size()) != groups || ss.rollout != &ro ||
        ss.keep_group != &keep)
      throw Error(fmt::format("step hook '{}' (after_scoring): the step's samples or groups changed; change scores "
                              "only, and drop groups by setting keep_group[g] = 0",
                              name));
    for (int64_t s = 0; s < samples; ++s)
      if (!std::isfinite(ro.score[static_cast<size_t>(s)]))
        throw Error(fmt::format("step hook '{}' (after_scoring): sample {} (prompt group {}) has the score {}; "
                                "scores must be finite",
                                name, s, ro.prompt[static_cast<size_t>(s)], ro.score[static_cast<size_t>(s)]));
  }
  return keep;
}

bool StepHookRunner::step_end(int64_t step, Metrics& metrics) {
  std::set<std::string> known;
  for (const auto& [k, v] : metrics) known.insert(k);
  for (const auto& [name, h] : hooks_) {
    if (!h->step_end) continue;
    Metrics added;
    bool stop = false;
    const Metrics seen = metrics;
    StepEnd se;
    se.step = step;
    se.metrics = &seen;
    se.add = &added;
    se.stop = &stop;
    call(name, "step_end", [&] { h->step_end(se); });
    for (const auto& [k, v] : added) {
      if (k.empty() || known.count(k))
        throw Error(fmt::format("step hook '{}' (step_end): the metric '{}' {}; give its own name", name, k,
                                k.empty() ? "has no name" : "is logged already"));
      known.insert(k);
      metrics.emplace_back(k, v);
    }
    if (stop && stopped_by_.empty()) stopped_by_ = name;
  }
  return !stopped_by_.empty();
}

void StepHookRunner::checkpoint(int64_t step, const std::string& dir) const {
  for (const auto& [name, h] : hooks_)
    if (h->checkpoint) call(name, "checkpoint", [&] { h->checkpoint(CheckpointSaved{step, dir}); });
}

}  // namespace tiller::controller
