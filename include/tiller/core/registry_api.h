// The declaration of a registry's public functions (core/registry.h is the mechanism), light
// enough for any public header: the naming scheme every registry follows.
#pragma once

#include <string>
#include <vector>

// One registry's public functions, declared in its header with one line:
//   TILLER_REGISTRY_API(advantage_estimator, AdvantageEstimatorDef);
// declares, in the enclosing namespace,
//   void register_advantage_estimator(const std::string& name, AdvantageEstimatorDef entry);
//   const AdvantageEstimatorDef& find_advantage_estimator(const std::string& name);  // ConfigError when missing
//   std::vector<std::string> advantage_estimator_names();                           // sorted
// and its .cpp defines them with one more (TILLER_REGISTRY_DEFINE, tiller/core/registry.h).
#define TILLER_REGISTRY_API(x, T)                                 \
  void register_##x(const std::string& name, T entry);            \
  const T& find_##x(const std::string& name);                     \
  std::vector<std::string> x##_names()
