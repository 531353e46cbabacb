// The registry of in-process environments (environment.h): a tiller::Registry.
#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/registry.h"
#include "tiller/env/environment.h"

namespace tiller::env {
namespace {

// No built-ins: each entry is a user's (or a test's), added before the job starts.
Registry<EnvFactory>& registry() {
  static auto* r =
      new Registry<EnvFactory>("in-process environment", [](const EnvFactory& f) { return f ? "" : "no factory"; });
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(env, EnvFactory, registry, "env.name")

std::unique_ptr<Environment> make_env(const std::string& name) {
  const EnvFactory* factory = nullptr;
  try {
    factory = &find_env(name);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}; register it with tiller::env::register_env before the job starts, or serve "
                                  "it over gRPC (env.type: remote)",
                                  e.what()));
  }
  std::unique_ptr<Environment> e = (*factory)();
  TILLER_CHECK(e != nullptr, "the factory of environment '{}' returned nothing", name);
  return e;
}

}  // namespace tiller::env
