// The config schema's construction, private to src/core: the bounds of user-given sizes, the
// Builder that the schema's parts add their fields with, and the parts, each a concept's keys in
// the order the reference (docs/config.md) lists them:
//   config_schema_layout.cpp  run, cluster, roles, engines: where the job's ranks go and what they hold
//   config_schema_rl.cpp      rollout, algo, data, reward, env, agent, train: the RL loop's settings
//   config_schema.cpp         eval, checkpoint, logging, offline, timeouts, and the schema's lookups
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "config_schema.h"

namespace tiller::config_schema::detail {

// Upper bounds of user-given sizes. Every number in the schema has both bounds (fields() checks),
// so a sum or product of a few of them cannot overflow 64 bits and no count is absurd enough to
// become an allocation that kills a rank.
constexpr double kMaxSampleTokens = 1 << 24;  // tokens of one prompt or one completion
constexpr double kMaxBatchTokens = 1 << 30;   // tokens of one packed micro-batch
constexpr double kMaxCount = 1e9;             // steps, samples, prompts
constexpr double kMaxSeconds = 1e7;           // a deadline (~116 days)
constexpr double kMaxSeed = 9.2e18;           // below 2^63

template <typename T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, bool>) return Kind::kBool;
  else if constexpr (std::is_same_v<T, std::int64_t>) return Kind::kInt;
  else if constexpr (std::is_same_v<T, double>) return Kind::kDouble;
  else {
    static_assert(std::is_same_v<T, std::string>, "config fields are bool, int64, double or string");
    return Kind::kString;
  }
}

class Builder {
 public:
  template <typename Get>
  Field& add(std::string path, Get get, std::string doc) {
    using T = std::remove_pointer_t<decltype(get(std::declval<JobConfig&>()))>;
    fields_.push_back(Field{std::move(path), kind_of<T>(),
                            [get](JobConfig& c) -> void* { return get(c); }, {}, {}, std::move(doc),
                            std::nullopt, std::nullopt, {}});
    return fields_.back();
  }
  // A config enum: its choices are EnumNames<E>::names.
  template <typename Get>
  Field& add_enum(std::string path, Get get, std::string doc) {
    using E = std::remove_pointer_t<decltype(get(std::declval<JobConfig&>()))>;
    std::vector<std::string> names;
    for (std::string_view n : EnumNames<E>::names) names.emplace_back(n);
    fields_.push_back(Field{std::move(path), Kind::kEnum, {},
                            [get](const JobConfig& c) { return static_cast<int>(*get(const_cast<JobConfig&>(c))); },
                            [get](JobConfig& c, int v) { *get(c) = static_cast<E>(v); }, std::move(doc),
                            std::nullopt, std::nullopt, std::move(names)});
    return fields_.back();
  }
  std::vector<Field> take() { return std::move(fields_); }

 private:
  std::vector<Field> fields_;
};

// A field's address in a JobConfig, for Builder::add.
#define TILLER_FIELD(expr) [](JobConfig& c) { return &c.expr; }

// The parts of the schema, in its order.
void add_layout_fields(Builder& b);
void add_rl_fields(Builder& b);

}  // namespace tiller::config_schema::detail
