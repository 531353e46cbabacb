// Named components that a trainer of one's own can add to: one mechanism behind the registries
// (the algorithm pieces, reward scorers and rule rewards, in-process environments, prompt
// sources, step hooks, sample loops and agent harnesses; docs/library.md lists them), each with
// the same three functions: register_x, find_x and x_names (TILLER_REGISTRY_API below). A
// registry holds entries by name; tiller's built-in entries go in through the same `add` as a
// user's, the first time the registry is used, so a user's registration before `run_main` sits
// beside them.
//
// Names: 1 to 64 of [a-z0-9_.-]; a name is registered once (a second `add` of it is an error,
// never a silent replacement). Looking up a name that is not there is a ConfigError naming the
// config key, the registered names and the closest one:
//   algo.advantage_estimator = 'grop': not a registered advantage estimator (registered: dr_grpo,
//   gae, group_norm, ...); did you mean 'gae'?
// Thread-safe: registrations and lookups may come from any thread; an entry, once added, stays
// at its address for the life of the process.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tiller/core/error.h"
#include "tiller/core/registry_api.h"
#include "tiller/core/spelling.h"

namespace tiller {

// Whether `name` is a valid registry name (see above).
inline bool valid_registry_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-')) return false;
  return true;
}

template <typename T>
class Registry {
 public:
  // `what`: the kind of entry, in messages ("advantage estimator"). `invalid`, when given, says
  // what is wrong with an entry ("no compute function"), or "" for a good one: `add` refuses it.
  explicit Registry(std::string what, std::function<std::string(const T&)> invalid = {})
      : what_(std::move(what)), invalid_(std::move(invalid)) {}
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  void add(const std::string& name, T entry) {
    if (invalid_)
      if (const std::string why = invalid_(entry); !why.empty())
        throw ConfigError(fmt::format("{} '{}': {}", what_, name, why));
    if (!valid_registry_name(name))
      throw ConfigError(fmt::format("{} name '{}': use 1 to 64 of a-z, 0-9, '_', '.', '-'", what_, name));
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.count(name) != 0)
      throw ConfigError(fmt::format("{} '{}' is registered already; register each name once", what_, name));
    entries_.emplace(name, std::move(entry));
  }

  // The entry, or nullptr.
  const T* find(std::string_view name) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(std::string(name));
    return it == entries_.end() ? nullptr : &it->second;
  }

  // The entry; a ConfigError naming `key` (the config key that gave the name) when it is missing.
  const T& at(std::string_view name, std::string_view key) const {
    if (const T* e = find(name)) return *e;
    const std::vector<std::string> all = names();
    const std::string near = closest_word(name, all);
    if (all.empty())
      throw ConfigError(fmt::format("{} = '{}': not a registered {} (none is registered: a trainer of your own "
                                    "registers them before tiller::run_main)",
                                    key, name, what_));
    throw ConfigError(fmt::format("{} = '{}': not a registered {} (registered: {}){}", key, name, what_,
                                  fmt::join(all, ", "), near.empty() ? "" : fmt::format("; did you mean '{}'?", near)));
  }

  bool contains(std::string_view name) const { return find(name) != nullptr; }

  // Every name, sorted.
  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    out.reserve(entries_.size());
    for (const auto& [name, entry] : entries_) out.push_back(name);
    return out;
  }

  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::function<std::string(const T&)> invalid_;
  mutable std::mutex mu_;
  std::map<std::string, T, std::less<>> entries_;
};

}  // namespace tiller

// Defines a registry's three functions (declared by TILLER_REGISTRY_API, tiller/core/registry_api.h)
// over the function that returns its Registry<T>, built-ins added on first use, and the config
// key that names an entry:
//   TILLER_REGISTRY_DEFINE(advantage_estimator, AdvantageEstimatorDef, registry, "algo.advantage_estimator")
#define TILLER_REGISTRY_DEFINE(x, T, registry_fn, key)                                                \
  void register_##x(const std::string& name, T entry) { registry_fn().add(name, std::move(entry)); } \
  const T& find_##x(const std::string& name) { return registry_fn().at(name, key); }                 \
  std::vector<std::string> x##_names() { return registry_fn().names(); }
