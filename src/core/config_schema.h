// The config schema: every key of JobConfig, declared once. Private to src/core.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tiller/core/config.h"

namespace tiller::config_schema {

// kEnum: a config enum (tiller/core/config.h), read and written through its names (`choices`).
enum class Kind { kBool, kInt, kDouble, kString, kEnum };

struct Field {
  std::string path;  // "roles.actor.gpus"
  Kind kind;
  std::function<void*(JobConfig&)> get;  // points at the field inside a JobConfig (not for kEnum)
  std::function<int(const JobConfig&)> get_enum;  // kEnum: the value's index in `choices`
  std::function<void(JobConfig&, int)> set_enum;
  std::string doc;
  std::optional<double> min;
  std::optional<double> max;
  std::vector<std::string> choices;  // strings only; empty = any string
  bool list = false;  // strings only: a YAML list of names is accepted too, kept comma-separated
  bool json_map = false;  // strings only: a YAML mapping (or {} text), kept as a JSON object's text

  Field& range(std::optional<double> lo, std::optional<double> hi) {
    min = lo;
    max = hi;
    return *this;
  }
  Field& one_of(std::vector<std::string> c) {
    choices = std::move(c);
    return *this;
  }
  Field& as_list() {
    list = true;
    return *this;
  }
  Field& as_json_map() {
    json_map = true;
    return *this;
  }
};

// The sections in order, with one line of documentation each.
struct Section {
  std::string path;
  std::string doc;
};

const std::vector<Field>& fields();
const std::vector<Section>& sections();
const char* kind_name(Kind k);

}  // namespace tiller::config_schema
