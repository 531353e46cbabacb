// The registry of in-process environments (environment.h).
#include <map>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tiller/core/error.h"
#include "tiller/env/environment.h"

namespace tiller::env {
namespace {

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

std::map<std::string, EnvFactory>& registry() {
  static std::map<std::string, EnvFactory> r;
  return r;
}

}  // namespace

void register_env(const std::string& name, EnvFactory factory) {
  if (name.empty()) throw ConfigError("register_env: the environment's name is empty");
  if (!factory) throw ConfigError(fmt::format("register_env('{}'): no factory", name));
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (!registry().emplace(name, std::move(factory)).second)
    throw ConfigError(fmt::format("register_env('{}'): the name is taken", name));
}

std::unique_ptr<Environment> make_env(const std::string& name) {
  EnvFactory f;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(name);
    if (it != registry().end()) f = it->second;
  }
  if (!f) {
    const auto known = env_names();
    throw ConfigError(fmt::format("no in-process environment '{}' (registered: {}); register it with "
                                  "tiller::env::register_env before the job starts, or serve it over gRPC",
                                  name, known.empty() ? "none" : fmt::format("{}", fmt::join(known, ", "))));
  }
  std::unique_ptr<Environment> e = f();
  TILLER_CHECK(e != nullptr, "the factory of environment '{}' returned nothing", name);
  return e;
}

std::vector<std::string> env_names() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> out;
  for (const auto& [name, f] : registry()) out.push_back(name);
  return out;
}

}  // namespace tiller::env
