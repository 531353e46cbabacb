#include "tiller/model/lora.h"

#include <cmath>
#include <filesystem>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/model/safetensors.h"

namespace tiller::model {
namespace {

constexpr std::array<const char*, kLoraModules> kNames = {"q_proj",    "k_proj",  "v_proj",  "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"};
constexpr const char* kPeftPrefix = "base_model.model.";

bool is_mlp(size_t m) { return m >= static_cast<size_t>(LoraModule::kGate); }

// The projection's [out, in].
std::pair<int64_t, int64_t> module_shape(const ModelConfig& c, size_t m) {
  switch (static_cast<LoraModule>(m)) {
    case LoraModule::kQ: return {c.q_size(), c.hidden_size};
    case LoraModule::kK:
    case LoraModule::kV: return {c.kv_size(), c.hidden_size};
    case LoraModule::kO: return {c.hidden_size, c.q_size()};
    case LoraModule::kGate:
    case LoraModule::kUp: return {c.intermediate_size, c.hidden_size};
    case LoraModule::kDown: return {c.hidden_size, c.intermediate_size};
  }
  return {0, 0};
}

std::string module_path(int64_t layer, size_t m) {
  return fmt::format("model.layers.{}.{}.{}", layer, is_mlp(m) ? "mlp" : "self_attn", kNames[m]);
}
std::string a_name(int64_t layer, size_t m) { return module_path(layer, m) + ".lora_A.weight"; }
std::string b_name(int64_t layer, size_t m) { return module_path(layer, m) + ".lora_B.weight"; }

std::string trim(std::string s) {
  const auto a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

}  // namespace

double LoraSpec::scale() const {
  TILLER_CHECK(rank > 0, "LoRA scale of rank {}", rank);
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

const char* lora_module_name(LoraModule m) { return kNames[static_cast<size_t>(m)]; }

std::array<bool, kLoraModules> lora_targets(const std::string& list, const ModelConfig& cfg, const std::string& key) {
  std::array<bool, kLoraModules> t{};
  const std::string all = trim(list);
  if (all == "all-linear") {
    t.fill(true);
  } else {
    size_t start = 0;
    while (start <= all.size()) {
      const size_t comma = all.find(',', start);
      const std::string name = trim(all.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      start = comma == std::string::npos ? all.size() + 1 : comma + 1;
      if (name.empty()) continue;
      const auto it = std::find(kNames.begin(), kNames.end(), name);
      if (it == kNames.end())
        throw ConfigError(fmt::format("{} = '{}': '{}' is not a projection tiller adapts; use all-linear or a list of "
                                      "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
                                      key, list, name));
      t[static_cast<size_t>(it - kNames.begin())] = true;
    }
  }
  if (std::none_of(t.begin(), t.end(), [](bool b) { return b; }))
    throw ConfigError(fmt::format("{} is empty: name the projections to adapt, or all-linear", key));
  if (cfg.moe()) {
    bool mlp = false;
    for (size_t m = 0; m < t.size(); ++m) mlp |= t[m] && is_mlp(m);
    if (all == "all-linear") {  // the attention of a mixture of experts; its experts take none
      for (size_t m = 0; m < t.size(); ++m) t[m] = !is_mlp(m);
    } else if (mlp) {
      throw ConfigError(fmt::format("{} = '{}': a mixture of experts takes adapters on its attention only "
                                    "(q_proj, k_proj, v_proj, o_proj); its experts' MLPs take none",
                                    key, list));
    }
  }
  return t;
}

std::vector<ParamSpec> lora_parameter_specs(const ModelConfig& cfg, const LoraSpec& spec) {
  std::vector<ParamSpec> out;
  if (!spec.enabled()) return out;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    for (size_t m = 0; m < spec.targets.size(); ++m) {
      if (!spec.targets[m]) continue;
      const auto [o, i] = module_shape(cfg, m);
      ParamSpec a, b;
      a.name = a_name(l, m);
      a.shape = {spec.rank, i};
      a.layer = static_cast<int>(l);
      b.name = b_name(l, m);
      b.shape = {o, spec.rank};
      b.layer = static_cast<int>(l);
      out.push_back(a);
      out.push_back(b);
    }
  return out;
}

NamedTensors named_lora(const ModelWeights& w) {
  NamedTensors out;
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LoraAdapters& a = w.layers[l].lora;
    for (size_t m = 0; m < a.a.size(); ++m) {
      if (!a.a[m].defined()) continue;
      out[a_name(static_cast<int64_t>(l), m)] = a.a[m];
      out[b_name(static_cast<int64_t>(l), m)] = a.b[m];
    }
  }
  return out;
}

NamedTensors init_lora(const ModelConfig& cfg, const LoraSpec& spec, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  NamedTensors out;
  for (const ParamSpec& p : lora_parameter_specs(cfg, spec)) {
    const bool is_a = p.name.size() > 14 && p.name.compare(p.name.size() - 14, 14, ".lora_A.weight") == 0;
    if (is_a) {
      // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
      const double bound = 1.0 / std::sqrt(static_cast<double>(p.shape[1]));
      out[p.name] = at::empty(p.shape, at::kFloat).uniform_(-bound, bound, gen);
    } else {
      out[p.name] = at::zeros(p.shape, at::kFloat);
    }
  }
  return out;
}

void bind_lora(const ModelConfig& cfg, const LoraSpec& spec, const NamedTensors& named, ModelWeights& w,
               const std::string& where) {
  TILLER_CHECK(static_cast<int64_t>(w.layers.size()) == cfg.num_layers, "bind_lora: {} layers, config {}",
               w.layers.size(), cfg.num_layers);
  if (!spec.enabled()) return;
  const double scale = spec.scale();
  for (const ParamSpec& p : lora_parameter_specs(cfg, spec)) {
    const auto it = named.find(p.name);
    if (it == named.end()) throw IoError(fmt::format("{}: the adapter lacks '{}'", where, p.name));
    if (it->second.sizes().vec() != p.shape)
      throw IoError(fmt::format("{}: '{}' is {}, the model and rank {} need {}", where, p.name,
                                fmt::join(it->second.sizes(), "x"), spec.rank, fmt::join(p.shape, "x")));
  }
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    LoraAdapters& a = w.layers[static_cast<size_t>(l)].lora;
    a.scale = scale;
    for (size_t m = 0; m < spec.targets.size(); ++m) {
      if (!spec.targets[m]) continue;
      a.a[m] = named.at(a_name(l, m));
      a.b[m] = named.at(b_name(l, m));
    }
  }
}

PeftAdapter read_peft_adapter(const std::string& dir, const ModelConfig& cfg) {
  const std::string cfg_path = dir + "/adapter_config.json";
  const std::optional<std::string> text = read_file(cfg_path);
  if (!text) throw IoError(fmt::format("{}: no such file (a PEFT adapter directory holds adapter_config.json and "
                                       "adapter_model.safetensors)",
                                       cfg_path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(*text);
  } catch (const std::exception& e) {
    throw IoError(fmt::format("{}: not JSON: {}", cfg_path, e.what()));
  }
  auto fail = [&](const std::string& why) { return ConfigError(fmt::format("{}: {}", cfg_path, why)); };
  if (j.value("peft_type", std::string("LORA")) != "LORA")
    throw fail(fmt::format("peft_type {} is not LORA", j.value("peft_type", std::string())));
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1 || j["r"].get<int64_t>() > 4096)
    throw fail("'r' must be an integer in [1, 4096]");
  if (j.contains("bias") && j["bias"].is_string() && j["bias"].get<std::string>() != "none")
    throw fail(fmt::format("bias '{}': tiller trains adapters without biases (bias none)", j["bias"].get<std::string>()));
  for (const char* variant : {"use_dora", "fan_in_fan_out", "lora_bias", "use_qalora"})
    if (j.contains(variant) && j[variant].is_boolean() && j[variant].get<bool>())
      throw fail(fmt::format("{} is true; tiller runs plain LoRA", variant));
  for (const char* key : {"layers_to_transform", "exclude_modules", "target_parameters", "layer_replication"})
    if (j.contains(key) && !j[key].is_null() && !(j[key].is_array() && j[key].empty()))
      throw fail(fmt::format("{} is set; tiller adapts the target modules of every layer", key));
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (j.contains(key) && j[key].is_object() && !j[key].empty())
      throw fail(fmt::format("{} is set; tiller gives every projection the same rank and alpha", key));
  if (j.contains("modules_to_save") && j["modules_to_save"].is_array() && !j["modules_to_save"].empty())
    throw fail("modules_to_save is set; tiller's adapters hold LoRA matrices only");
  PeftAdapter out;
  out.spec.rank = j["r"].get<int64_t>();
  out.spec.alpha = j.value("lora_alpha", 8.0);
  out.spec.use_rslora = j.value("use_rslora", false);
  out.dropout = j.value("lora_dropout", 0.0);
  std::string targets;
  if (j.contains("target_modules") && j["target_modules"].is_array()) {
    for (const auto& t : j["target_modules"]) targets += (targets.empty() ? "" : ",") + t.get<std::string>();
  } else if (j.contains("target_modules") && j["target_modules"].is_string()) {
    targets = j["target_modules"].get<std::string>();
    if (targets == "all-linear" || targets.find_first_of("().*|[]\\") == std::string::npos) {
    } else {
      throw fail(fmt::format("target_modules '{}' is a pattern; tiller reads a list of projection names", targets));
    }
  } else {
    throw fail("no target_modules");
  }
  out.spec.targets = lora_targets(targets, cfg, cfg_path + " target_modules");
  const std::string weights = dir + "/adapter_model.safetensors";
  if (!std::filesystem::exists(weights))
    throw IoError(fmt::format("{}: no such file (tiller reads adapters in safetensors)", weights));
  SafetensorsFile file(weights);
  for (const TensorEntry& e : file.entries()) {
    std::string name = e.name;
    if (name.rfind(kPeftPrefix, 0) == 0) name = name.substr(std::string(kPeftPrefix).size());
    // PEFT saves without the adapter's name ("...lora_A.weight"); an older save has ".default".
    const auto d = name.find(".lora_A.default.weight") != std::string::npos ? name.find(".default.") : std::string::npos;
    if (d != std::string::npos) name.erase(d, 8);
    const auto d2 = name.find(".lora_B.default.weight");
    if (d2 != std::string::npos) name.erase(d2 + 7, 8);
    out.tensors[name] = file.tensor(e.name).to(at::kFloat).clone();
  }
  ModelWeights probe;
  probe.layers.resize(static_cast<size_t>(cfg.num_layers));
  bind_lora(cfg, out.spec, out.tensors, probe, weights);  // names and shapes
  for (const auto& [name, t] : out.tensors) {
    bool known = false;
    for (const ParamSpec& p : lora_parameter_specs(cfg, out.spec)) known |= p.name == name;
    if (!known)
      throw fail(fmt::format("the adapter holds '{}', which its target_modules and the model do not make", name));
  }
  return out;
}

void write_peft_adapter(const std::string& dir, const ModelConfig& cfg, const LoraSpec& spec, double dropout,
                        const NamedTensors& tensors, const std::string& base_model) {
  TILLER_CHECK(spec.enabled(), "write_peft_adapter: rank 0");
  std::filesystem::create_directories(dir);
  NamedTensors out;
  for (const ParamSpec& p : lora_parameter_specs(cfg, spec)) {
    const auto it = tensors.find(p.name);
    TILLER_CHECK(it != tensors.end(), "write_peft_adapter: '{}' missing", p.name);
    out[kPeftPrefix + p.name] = it->second.detach().to(at::kCPU, at::kFloat).contiguous();
  }
  nlohmann::json targets = nlohmann::json::array();
  for (size_t m = 0; m < spec.targets.size(); ++m)
    if (spec.targets[m]) targets.push_back(kNames[m]);
  nlohmann::json j = {{"peft_type", "LORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"base_model_name_or_path", base_model},
                      {"r", spec.rank},
                      {"lora_alpha", spec.alpha},
                      {"lora_dropout", dropout},
                      {"target_modules", targets},
                      {"use_rslora", spec.use_rslora},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"inference_mode", true},
                      {"init_lora_weights", true},
                      {"modules_to_save", nullptr}};
  write_safetensors(dir + "/adapter_model.safetensors", out);
  write_file_atomic(dir + "/adapter_config.json", j.dump(2) + "\n");
}

at::Tensor merge_lora(const at::Tensor& w, const at::Tensor& a, const at::Tensor& b, double scale) {
  TILLER_CHECK(a.dim() == 2 && b.dim() == 2 && b.size(1) == a.size(0) && w.size(0) == b.size(0) &&
                   w.size(1) == a.size(1),
               "merge_lora: W {} with A {} and B {}", fmt::join(w.sizes(), "x"), fmt::join(a.sizes(), "x"),
               fmt::join(b.sizes(), "x"));
  const at::Tensor delta = at::matmul(b.to(w.device(), at::kFloat), a.to(w.device(), at::kFloat)) * scale;
  return (w.to(at::kFloat) + delta).to(w.scalar_type());
}

NamedTensors merge_lora(const ModelConfig& cfg, const LoraSpec& spec, const NamedTensors& base,
                        const NamedTensors& adapters) {
  NamedTensors out = base;
  if (!spec.enabled()) return out;
  const double scale = spec.scale();
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    for (size_t m = 0; m < spec.targets.size(); ++m) {
      if (!spec.targets[m]) continue;
      const std::string w = module_path(l, m) + ".weight";
      const auto it = base.find(w);
      if (it == base.end()) throw IoError(fmt::format("merge_lora: the base lacks '{}'", w));
      out[w] = merge_lora(it->second, adapters.at(a_name(l, m)), adapters.at(b_name(l, m)), scale);
    }
  return out;
}

}  // namespace tiller::model

namespace tiller::model {

int64_t write_merged_model(const std::string& base_dir, const LoraSpec& spec, const NamedTensors& adapters,
                           const std::string& out_dir, std::optional<at::ScalarType> dtype) {
  namespace fs = std::filesystem;
  if (fs::exists(out_dir) && fs::exists(base_dir) && fs::equivalent(out_dir, base_dir))
    throw ConfigError(fmt::format("{} is the base model's directory; write the merged model elsewhere", out_dir));
  const ModelConfig cfg = load_model_config(base_dir);
  const CheckpointReader reader(base_dir);
  NamedTensors merged = merge_lora(cfg, spec, reader.all(), adapters);
  if (dtype)
    for (auto& [name, w] : merged) w = w.to(*dtype);
  fs::create_directories(out_dir);
  for (const char* name : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                           "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                           "added_tokens.json", "chat_template.jinja"}) {  // the model's files but its weights
    const fs::path src = fs::path(base_dir) / name;
    if (fs::exists(src)) fs::copy_file(src, fs::path(out_dir) / name, fs::copy_options::overwrite_existing);
  }
  if (dtype) {  // the config's dtype follows the weights
    nlohmann::json c = nlohmann::json::parse(read_file(out_dir + "/config.json").value_or("{}"));
    const char* hf = *dtype == at::kBFloat16 ? "bfloat16" : *dtype == at::kHalf ? "float16" : "float32";
    if (c.contains("dtype")) c["dtype"] = hf;
    c["torch_dtype"] = hf;
    write_file_atomic(out_dir + "/config.json", c.dump(2) + "\n");
  }
  write_checkpoint(out_dir, merged);
  int64_t n = 0;
  for (bool t : spec.targets) n += t ? cfg.num_layers : 0;
  return n;
}

}  // namespace tiller::model
