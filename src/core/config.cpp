#include "tiller/core/config.h"

#include <algorithm>
#include <utility>
#include <cmath>
#include <map>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "config_schema.h"
#include "tiller/core/error.h"
#include "tiller/core/hub.h"
#include "tiller/core/files.h"
#include "tiller/core/spelling.h"

namespace tiller {
namespace {

using config_schema::Field;
using config_schema::Kind;

const Field* find_field(const std::string& path) {
  for (const Field& f : config_schema::fields()) {
    if (f.path == path) return &f;
  }
  return nullptr;
}

bool is_section(const std::string& path) {
  const std::string prefix = path + ".";
  for (const Field& f : config_schema::fields()) {
    if (f.path.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
  return parts;
}

// The valid key (or section) closest to `path` among those of the same depth and parent; if the
// parent itself is valid only its children are considered, so "roles.actor.gpu" suggests
// "roles.actor.gpus" and not "roles.critic.gpus".
std::string closest_key(const std::string& path) {
  const auto parts = split_path(path);
  const std::size_t depth = parts.size();
  std::string parent;
  for (std::size_t i = 0; i + 1 < depth; ++i) parent += (i ? "." : "") + parts[i];
  const bool parent_valid = parent.empty() || is_section(parent);
  std::string best;
  std::size_t best_d = SIZE_MAX;
  for (const Field& f : config_schema::fields()) {
    auto fp = split_path(f.path);
    if (fp.size() < depth) continue;
    std::string candidate;
    for (std::size_t i = 0; i < depth; ++i) candidate += (i ? "." : "") + fp[i];
    if (parent_valid && candidate.compare(0, parent.size(), parent) != 0) continue;
    std::size_t d = edit_distance(path, candidate);
    if (d < best_d) {
      best_d = d;
      best = candidate;
    }
  }
  return best;
}

std::string format_double(double v) { return fmt::format("{}", v); }

std::string range_text(const Field& f) {
  if (f.min && f.max) return fmt::format("[{}, {}]", format_double(*f.min), format_double(*f.max));
  if (f.min) return fmt::format(">= {}", format_double(*f.min));
  if (f.max) return fmt::format("<= {}", format_double(*f.max));
  return "";
}

std::string choices_text(const Field& f) {
  std::string out;
  for (const auto& c : f.choices) out += (out.empty() ? "" : ", ") + (c.empty() ? std::string("\"\"") : c);
  return out;
}

// A YAML node as JSON text: mappings and sequences as objects and arrays; a plain scalar as a
// bool (true/false), null (null, ~), or a number when it reads as one, else a string; a quoted
// scalar always a string.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += fmt::format("\\u{:04x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string yaml_to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    std::string out = "{";
    for (const auto& kv : n) out += (out.size() > 1 ? ", " : "") + json_string(kv.first.Scalar()) + ": " + yaml_to_json(kv.second);
    return out + "}";
  }
  if (n.IsSequence()) {
    std::string out = "[";
    for (const auto& item : n) out += (out.size() > 1 ? ", " : "") + yaml_to_json(item);
    return out + "]";
  }
  if (n.IsNull()) return "null";
  const std::string& v = n.Scalar();
  if (n.Tag() == "!") return json_string(v);  // quoted
  if (v == "true" || v == "True" || v == "TRUE") return "true";
  if (v == "false" || v == "False" || v == "FALSE") return "false";
  if (v == "null" || v == "~" || v == "Null" || v == "NULL") return "null";
  long long i;
  double d;
  if (YAML::convert<long long>::decode(n, i)) return std::to_string(i);
  if (YAML::convert<double>::decode(n, d) && std::isfinite(d)) return fmt::format("{}", d);
  return json_string(v);
}

// Sets field `f` of `config` from a YAML scalar. `where` is "file:line" or "--set".
void assign(JobConfig& config, const Field& f, const YAML::Node& value, const std::string& where) {
  const std::string shown = value.IsScalar() ? value.Scalar() : std::string();
  auto fail = [&](const std::string& why) {
    throw ConfigError(fmt::format("{}: {} {}", where, f.path, why));
  };
  if (value.IsNull() && f.kind != Kind::kString) fail("needs a value (" + std::string(kind_name(f.kind)) + ")");
  if (f.json_map) {  // a mapping, or its text ({"a": 1}: JSON is YAML), kept as a JSON object's text
    YAML::Node map = value;
    if (value.IsScalar() && !value.Scalar().empty()) {
      try {
        map = YAML::Load(value.Scalar());
      } catch (const YAML::Exception& e) {
        fail(fmt::format("= '{}' is not a mapping: {}", shown, e.msg));
      }
    }
    if (map.IsNull() || (map.IsScalar() && map.Scalar().empty())) {
      *static_cast<std::string*>(f.get(config)) = "";
      return;
    }
    if (!map.IsMap()) fail("must be a mapping of names to values ({enable_thinking: false})");
    *static_cast<std::string*>(f.get(config)) = yaml_to_json(map);
    return;
  }
  if (f.list && value.IsSequence()) {  // [a, b] is "a,b"
    std::string joined;
    for (const auto& item : value) {
      if (!item.IsScalar() || item.Scalar().empty() || item.Scalar().find(',') != std::string::npos)
        fail("must be a list of names");
      joined += (joined.empty() ? "" : ",") + item.Scalar();
    }
    *static_cast<std::string*>(f.get(config)) = joined;
    return;
  }
  if (!value.IsNull() && !value.IsScalar()) fail(fmt::format("must be a {}, not a list or mapping", kind_name(f.kind)));
  void* target = f.kind == Kind::kEnum ? nullptr : f.get(config);
  auto check_range = [&](double v) {
    if ((f.min && v < *f.min) || (f.max && v > *f.max)) {
      fail(fmt::format("= {} is out of range: must be in {}", shown, range_text(f)));
    }
  };
  switch (f.kind) {
    case Kind::kBool: {
      bool v;
      if (!YAML::convert<bool>::decode(value, v)) fail(fmt::format("= '{}' is not a bool (true or false)", shown));
      *static_cast<bool*>(target) = v;
      break;
    }
    case Kind::kInt: {
      long long v;
      if (!YAML::convert<long long>::decode(value, v)) fail(fmt::format("= '{}' is not an integer", shown));
      check_range(static_cast<double>(v));
      *static_cast<std::int64_t*>(target) = v;
      break;
    }
    case Kind::kDouble: {
      double v;
      if (!YAML::convert<double>::decode(value, v) || !std::isfinite(v)) {
        fail(fmt::format("= '{}' is not a number", shown));
      }
      check_range(v);
      *static_cast<double*>(target) = v;
      break;
    }
    case Kind::kString: {
      std::string v = value.IsNull() ? std::string() : value.Scalar();
      if (!f.choices.empty() && std::find(f.choices.begin(), f.choices.end(), v) == f.choices.end()) {
        fail(fmt::format("= '{}' is not one of {}", v, choices_text(f)));
      }
      *static_cast<std::string*>(target) = v;
      break;
    }
    case Kind::kEnum: {
      const std::string v = value.Scalar();
      const auto it = std::find(f.choices.begin(), f.choices.end(), v);
      if (it == f.choices.end()) fail(fmt::format("= '{}' is not one of {}", v, choices_text(f)));
      f.set_enum(config, static_cast<int>(it - f.choices.begin()));
      break;
    }
  }
}

// The value of `f` in `c` as text (YAML scalar without quotes).
std::string field_text(const JobConfig& config, const Field& f) {
  JobConfig& c = const_cast<JobConfig&>(config);  // Field::get is non-const; nothing is written
  switch (f.kind) {
    case Kind::kBool: return *static_cast<bool*>(f.get(c)) ? "true" : "false";
    case Kind::kInt: return std::to_string(*static_cast<std::int64_t*>(f.get(c)));
    case Kind::kDouble: return format_double(*static_cast<double*>(f.get(c)));
    case Kind::kString: return *static_cast<std::string*>(f.get(c));
    case Kind::kEnum: return f.choices.at(static_cast<size_t>(f.get_enum(config)));
  }
  return "";
}

// Keys that once existed: an error that says what replaced them (not a spelling suggestion).
void refuse_retired(const std::string& path, const std::string& where) {
  const std::string suffix = ".gradient_checkpointing";
  if (path.rfind("roles.", 0) == 0 && path.size() > suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0)
    throw ConfigError(fmt::format("{}: '{}' was replaced by train.recompute (auto, blocks, attention_only or none; "
                                  "blocks is what gradient_checkpointing: true did)",
                                  where, path));
}

void load_map(JobConfig& config, const YAML::Node& map, const std::string& prefix, const std::string& origin) {
  // YAML leaves a repeated key to the reader and yaml-cpp keeps both (the last one would win):
  // a repeated key or section is almost always an edit that went to the wrong place.
  std::map<std::string, int> seen;  // key -> its first line
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node& key = it->first;
    const int line = key.Mark().line + 1;
    const std::string where = fmt::format("{}:{}", origin, line);
    if (!key.IsScalar()) throw ConfigError(fmt::format("{}: keys must be plain names", where));
    const std::string path = prefix.empty() ? key.Scalar() : prefix + "." + key.Scalar();
    if (const auto [first, fresh] = seen.emplace(key.Scalar(), line); !fresh)
      throw ConfigError(fmt::format("{}: '{}' is given twice in this mapping (first at line {}); keep one", where, path,
                                    first->second));
    if (const Field* f = find_field(path)) {
      assign(config, *f, it->second, where);
    } else if (is_section(path)) {
      if (it->second.IsNull()) continue;  // "critic:" with nothing under it
      if (!it->second.IsMap()) {
        throw ConfigError(fmt::format("{}: '{}' is a section and must be a mapping of keys", where, path));
      }
      load_map(config, it->second, path, origin);
    } else {
      refuse_retired(path, where);
      throw ConfigError(fmt::format("{}: unknown key '{}'; did you mean '{}'?", where, path, closest_key(path)));
    }
  }
}

}  // namespace

void apply_override(JobConfig& config, const std::string& assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ConfigError(fmt::format("--set '{}': expected key=value, e.g. --set rollout.batch_size=512", assignment));
  }
  const std::string path = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  const Field* f = find_field(path);
  if (f == nullptr) {
    if (is_section(path)) {
      throw ConfigError(fmt::format("--set {}: '{}' is a section; set one of its keys, e.g. {}", path, path,
                                    closest_key(path + ".x")));
    }
    refuse_retired(path, "--set " + path);
    throw ConfigError(fmt::format("--set {}: unknown key '{}'; did you mean '{}'?", path, path, closest_key(path)));
  }
  YAML::Node value;
  try {
    value = text.empty() ? YAML::Node(YAML::NodeType::Null) : YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("--set {}: cannot parse value '{}': {}", path, text, e.msg));
  }
  if ((f->kind == Kind::kString || f->kind == Kind::kEnum) && value.IsScalar()) value = YAML::Node(text);  // "007" as written
  assign(config, *f, value, "--set");
}

JobConfig parse_config(const std::string& yaml_text, const std::string& origin,
                       const std::vector<std::string>& overrides) {
  JobConfig config;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}:{}: invalid YAML: {}", origin, e.mark.line + 1, e.msg));
  }
  if (root.IsDefined() && !root.IsNull()) {
    if (!root.IsMap()) throw ConfigError(fmt::format("{}: the config must be a mapping of sections", origin));
    load_map(config, root, "", origin);
  }
  for (const auto& o : overrides) apply_override(config, o);
  resolve_hub_models(config, /*strict=*/false);  // hub ids in the local cache become their folders
  config.validate();
  return config;
}

JobConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  const auto text = read_file(path);
  if (!text) throw ConfigError(fmt::format("{}: cannot open the config file (does it exist?)", path));
  return parse_config(*text, path, overrides);
}

std::string to_yaml(const JobConfig& config) {
  JobConfig& c = const_cast<JobConfig&>(config);  // Field::get is non-const; nothing is written
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // sections currently open
  for (const Field& f : config_schema::fields()) {
    auto parts = split_path(f.path);
    std::vector<std::string> sec(parts.begin(), parts.end() - 1);
    std::size_t common = 0;
    while (common < open.size() && common < sec.size() && open[common] == sec[common]) ++common;
    while (open.size() > common) {
      out << YAML::EndMap;
      open.pop_back();
    }
    while (open.size() < sec.size()) {
      out << YAML::Key << sec[open.size()] << YAML::Value << YAML::BeginMap;
      open.push_back(sec[open.size()]);
    }
    out << YAML::Key << parts.back() << YAML::Value;
    switch (f.kind) {
      case Kind::kBool: out << *static_cast<bool*>(f.get(c)); break;
      case Kind::kInt: out << static_cast<long long>(*static_cast<std::int64_t*>(f.get(c))); break;
      case Kind::kDouble: out << field_text(c, f); break;
      case Kind::kString:
      case Kind::kEnum: out << YAML::DoubleQuoted << field_text(c, f); break;
    }
  }
  while (!open.empty()) {
    out << YAML::EndMap;
    open.pop_back();
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string config_reference_markdown() {
  JobConfig defaults;
  std::string md =
      "# Configuration reference\n\n"
      "A tiller job is one YAML file with the sections below. Every key is optional; the default is\n"
      "shown. `--set a.b=c` on the command line overrides any key (the value in YAML syntax), and\n"
      "`tiller config -c FILE [--set ...]` prints the effective config.\n\n"
      "An unknown key is an error that names the key path, file and line and the closest valid key;\n"
      "a value of the wrong type or out of range names the key, the value and what is allowed.\n\n"
      "**Relative paths** (models, data, eval prompts, output and checkpoint folders, Python files)\n"
      "are relative to the directory tiller is started in, not to the config file: the bundled\n"
      "configs are written to run from the repository's root (`mpirun ... tiller train -c\n"
      "configs/quickstart.yaml`). From elsewhere, give absolute paths or `--set` them.\n\n"
      "This page is generated from the schema in `src/core/config_schema.cpp` by\n"
      "`tiller config --reference`; a unit test fails when it is out of date.\n";
  for (const auto& s : config_schema::sections()) {
    std::string rows;
    for (const Field& f : config_schema::fields()) {
      auto parts = split_path(f.path);
      std::string sec;
      for (std::size_t i = 0; i + 1 < parts.size(); ++i) sec += (i ? "." : "") + parts[i];
      if (sec != s.path) continue;
      std::string def = field_text(defaults, f);
      if (f.kind == Kind::kString || f.kind == Kind::kEnum) def = "\"" + def + "\"";
      std::string allowed = f.choices.empty() ? range_text(f) : "one of " + choices_text(f);
      rows += fmt::format("| `{}` | {} | `{}` | {} | {} |\n", f.path, kind_name(f.kind), def, allowed, f.doc);
    }
    md += fmt::format("\n## `{}`\n\n{}\n", s.path, s.doc);
    if (!rows.empty()) {
      md += "\n| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n" + rows;
    }
  }
  md +=
      "\n## Checks across keys\n\n"
      "- The actor is always enabled and never colocated; a colocated role names an enabled role that is not\n"
      "  itself colocated.\n"
      "- `algo.advantage_estimator` is a registered estimator; one that needs a critic (gae) needs the critic\n"
      "  enabled, the others need it disabled; group baselines (rloo, reinforce_baseline, group_norm,\n"
      "  dr_grpo) need `rollout.n_samples_per_prompt >= 2`; `algo.kl_estimator` is a registered KL estimator\n"
      "  (checked by `algo::check_config`, after loading).\n"
      "- `reward.type: model` needs the reward role enabled, and the other types need it disabled;\n"
      "  `reward.type: remote` needs `reward.remote_address`, `python` `reward.python`, `scorer` `reward.scorer`\n"
      "  (a registered batch scorer, checked when the job starts).\n"
      "- `tiller train`: `train.train_batch_size` divides `rollout.batch_size x rollout.n_samples_per_prompt`\n"
      "  (checked by `algo::check_config`; for sft, train-rm and dpo it is the records per step, free).\n"
      "- `algo.dual_clip` is 0 (off) or greater than 1; `algo.seq_mask_ratio` is 0 (off) or greater than 1.\n"
      "- `algo.importance_correction: tis` needs `algo.tis_cap > 0`, `mis` needs `algo.tis_cap > 1`; `algo.tis_cap > 0` "
      "needs a correction; `algo.is_level` other than token needs tis or mis, `algo.is_cap_lower` needs mis and lies "
      "below the cap.\n"
      "- `rollout.mode: sync` takes no `max_staleness > 0`, `partial` or `stale_policy: drop` (they are async's).\n"
      "- `rollout.filter_groups` needs `n_samples_per_prompt >= 2` and a reward other than `model`.\n"
      "- `reward.overlong_buffer` is at most `rollout.max_new_tokens` (with an environment, the sample's\n"
      "  response limit).\n"
      "- `env.type: remote` needs `env.address`, `inprocess` needs `env.name`; `reward.type: env`,\n"
      "  `rollout.max_turns > 1` and `rollout.max_response_tokens` need an environment;\n"
      "  `max_response_tokens` is 0 or at least `max_new_tokens`.\n"
      "- The rank plan (`tiller plan`) checks that the roles and engines fit the nodes; see docs/architecture.md.\n";
  return md;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const Field& f : config_schema::fields()) keys.push_back(f.path);
  return keys;
}

}  // namespace tiller
