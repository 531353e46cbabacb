#include "tiller/model/model_config.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller::model {
namespace {

using nlohmann::json;

struct Reader {
  const json& j;
  const std::string& where;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
  template <typename T>
  T get(const char* key, T fallback) const {
    if (!has(key)) return fallback;
    try {
      return j.at(key).get<T>();
    } catch (const json::exception&) {
      throw ConfigError(fmt::format("{}: key '{}' has the wrong type ({})", where, key, j.at(key).dump()));
    }
  }
  template <typename T>
  T need(const char* key) const {
    if (!has(key)) throw ConfigError(fmt::format("{}: required key '{}' is missing", where, key));
    return get<T>(key, T{});
  }
};

Family parse_family(const std::string& model_type, const std::string& where) {
  if (model_type == "llama") return Family::kLlama;
  if (model_type == "qwen2") return Family::kQwen2;
  if (model_type == "qwen3") return Family::kQwen3;
  if (model_type == "mistral") return Family::kMistral;
  if (model_type == "qwen2_moe") return Family::kQwen2Moe;
  if (model_type == "qwen3_moe") return Family::kQwen3Moe;
  if (model_type == "mixtral") return Family::kMixtral;
  throw ConfigError(fmt::format("{}: model_type '{}' is not supported; tiller runs llama, qwen2, qwen3, mistral, "
                                "qwen2_moe, qwen3_moe and mixtral",
                                where, model_type));
}

RopeScaling parse_rope(const json& r, const std::string& where, const char* key) {
  Reader rd{r, where};
  RopeScaling s;
  s.type = rd.get<std::string>("rope_type", rd.get<std::string>("type", "default"));
  if (s.type != "default" && s.type != "linear" && s.type != "dynamic" && s.type != "llama3" && s.type != "yarn")
    throw ConfigError(fmt::format("{}: {}.rope_type '{}' is not supported; use default, linear, dynamic, llama3 or yarn",
                                  where, key, s.type));
  s.factor = rd.get<double>("factor", 1.0);
  s.original_max_position_embeddings = rd.get<int64_t>("original_max_position_embeddings", 0);
  s.low_freq_factor = rd.get<double>("low_freq_factor", 1.0);
  s.high_freq_factor = rd.get<double>("high_freq_factor", 4.0);
  s.beta_fast = rd.get<double>("beta_fast", 32.0);
  s.beta_slow = rd.get<double>("beta_slow", 1.0);
  s.attention_factor = rd.get<double>("attention_factor", 0.0);
  s.truncate = rd.get<bool>("truncate", true);
  if (rd.has("mscale") || rd.has("mscale_all_dim"))
    throw ConfigError(fmt::format("{}: {}.mscale (DeepSeek-style yarn) is not supported", where, key));
  if (s.type != "default" && !(s.factor > 0))
    throw ConfigError(fmt::format("{}: {}.factor must be > 0, got {}", where, key, s.factor));
  if (s.type == "default") s.factor = 1.0;
  return s;
}

}  // namespace

const char* family_name(Family f) {
  switch (f) {
    case Family::kLlama: return "llama";
    case Family::kQwen2: return "qwen2";
    case Family::kQwen3: return "qwen3";
    case Family::kMistral: return "mistral";
    case Family::kQwen2Moe: return "qwen2_moe";
    case Family::kQwen3Moe: return "qwen3_moe";
    case Family::kMixtral: return "mixtral";
  }
  return "?";
}

bool ModelConfig::sparse_layer(int64_t i) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end()) return false;
  return (i + 1) % std::max<int64_t>(1, decoder_sparse_step) == 0;
}

ModelConfig parse_model_config(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("{}: not valid JSON ({})", where, e.what()));
  }
  if (!j.is_object()) throw ConfigError(fmt::format("{}: expected a JSON object", where));
  Reader rd{j, where};
  ModelConfig c;
  c.family = parse_family(rd.need<std::string>("model_type"), where);
  c.vocab_size = rd.need<int64_t>("vocab_size");
  c.hidden_size = rd.need<int64_t>("hidden_size");
  c.intermediate_size = rd.need<int64_t>("intermediate_size");
  c.num_layers = rd.need<int64_t>("num_hidden_layers");
  c.num_heads = rd.need<int64_t>("num_attention_heads");
  c.num_kv_heads = rd.get<int64_t>("num_key_value_heads", c.num_heads);
  c.head_dim = rd.get<int64_t>("head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.rms_norm_eps = rd.get<double>("rms_norm_eps", 1e-6);
  c.max_position_embeddings = rd.get<int64_t>("max_position_embeddings", 4096);
  c.tie_word_embeddings = rd.get<bool>("tie_word_embeddings", false);
  c.initializer_range = rd.get<double>("initializer_range", 0.02);
  c.torch_dtype = rd.get<std::string>("torch_dtype", rd.get<std::string>("dtype", "float32"));
  c.attention_bias = c.family == Family::kQwen2      ? true
                     : c.family == Family::kQwen2Moe ? rd.get<bool>("qkv_bias", true)
                                                     : rd.get<bool>("attention_bias", false);
  c.qk_norm = c.family == Family::kQwen3 || c.family == Family::kQwen3Moe;
  if (c.family == Family::kQwen2Moe || c.family == Family::kQwen3Moe || c.family == Family::kMixtral) {
    // 4.x names the count num_experts (qwen) or num_local_experts (mixtral); 5.x writes either.
    c.num_experts = rd.get<int64_t>("num_experts", rd.get<int64_t>("num_local_experts", 0));
    c.experts_per_token = rd.need<int64_t>("num_experts_per_tok");
    c.router_aux_loss_coef = rd.get<double>("router_aux_loss_coef", 0.001);
    if (c.num_experts <= 0)
      throw ConfigError(fmt::format("{}: num_experts (or num_local_experts) must be > 0 for {}", where,
                                    family_name(c.family)));
    if (c.family == Family::kMixtral) {
      c.moe_intermediate_size = c.intermediate_size;
      c.norm_topk_prob = true;
    } else {
      c.moe_intermediate_size = rd.need<int64_t>("moe_intermediate_size");
      c.norm_topk_prob = rd.get<bool>("norm_topk_prob", c.family == Family::kQwen3Moe);
      c.decoder_sparse_step = rd.get<int64_t>("decoder_sparse_step", 1);
      c.mlp_only_layers = rd.get<std::vector<int64_t>>("mlp_only_layers", {});
      if (c.family == Family::kQwen2Moe)
        c.shared_expert_intermediate_size = rd.need<int64_t>("shared_expert_intermediate_size");
    }
    if (rd.get<double>("router_jitter_noise", 0.0) != 0.0)
      throw ConfigError(fmt::format("{}: router_jitter_noise other than 0 is not supported", where));
  }

  const std::string act = rd.get<std::string>("hidden_act", "silu");
  if (act != "silu") throw ConfigError(fmt::format("{}: hidden_act '{}' is not supported (only silu)", where, act));
  if (rd.get<bool>("mlp_bias", false)) throw ConfigError(fmt::format("{}: mlp_bias true is not supported", where));
  if (rd.get<int64_t>("pretraining_tp", 1) != 1)
    throw ConfigError(fmt::format("{}: pretraining_tp other than 1 is not supported", where));

  // RoPE: 5.x keeps theta and scaling together in rope_parameters; 4.x has them apart.
  if (rd.has("rope_parameters")) {
    const json& rp = j.at("rope_parameters");
    if (!rp.is_object()) throw ConfigError(fmt::format("{}: rope_parameters must be an object", where));
    c.rope_scaling = parse_rope(rp, where, "rope_parameters");
    c.rope_theta = Reader{rp, where}.get<double>("rope_theta", 10000.0);
    if (Reader{rp, where}.get<double>("partial_rotary_factor", 1.0) != 1.0)
      throw ConfigError(fmt::format("{}: rope_parameters.partial_rotary_factor other than 1 is not supported", where));
  } else {
    c.rope_theta = rd.get<double>("rope_theta", 10000.0);
    if (rd.has("rope_scaling")) c.rope_scaling = parse_rope(j.at("rope_scaling"), where, "rope_scaling");
  }
  if (rd.get<double>("partial_rotary_factor", 1.0) != 1.0)
    throw ConfigError(fmt::format("{}: partial_rotary_factor other than 1 is not supported", where));

  // Sliding windows: Mistral applies one to every layer; Qwen2/3 name the layers in layer_types
  // (5.x) or use the window from max_window_layers on (4.x).
  const int64_t window = rd.get<int64_t>("sliding_window", 0);
  c.layer_window.assign(std::max<int64_t>(c.num_layers, 0), 0);
  if (c.family == Family::kMistral || c.family == Family::kLlama || c.family == Family::kMixtral) {
    if (c.family != Family::kLlama && window > 0) c.layer_window.assign(c.layer_window.size(), window);
  } else if (rd.has("layer_types")) {
    const auto types = rd.get<std::vector<std::string>>("layer_types", {});
    if ((int64_t)types.size() != c.num_layers)
      throw ConfigError(fmt::format("{}: layer_types has {} entries for {} layers", where, types.size(), c.num_layers));
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] == "sliding_attention") {
        if (window <= 0) throw ConfigError(fmt::format("{}: layer_types names sliding_attention but sliding_window is not set", where));
        c.layer_window[i] = window;
      } else if (types[i] != "full_attention") {
        throw ConfigError(fmt::format("{}: layer_types[{}] '{}' is not supported", where, i, types[i]));
      }
    }
  } else if (rd.get<bool>("use_sliding_window", false) && window > 0) {
    const int64_t from = rd.get<int64_t>("max_window_layers", 0);
    for (int64_t i = from; i < c.num_layers; ++i) c.layer_window[i] = window;
  }

  c.bos_token_id = rd.get<int64_t>("bos_token_id", -1);
  c.pad_token_id = rd.get<int64_t>("pad_token_id", -1);
  if (rd.has("eos_token_id")) {
    const json& e = j.at("eos_token_id");
    if (e.is_array()) c.eos_token_ids = e.get<std::vector<int64_t>>();
    else if (e.is_number_integer()) c.eos_token_ids = {e.get<int64_t>()};
  }
  validate(c, where);
  return c;
}

int64_t context_limit(const ModelConfig& cfg) {
  const RopeScaling& s = cfg.rope_scaling;
  if (s.type == "default" || !(s.factor > 1.0)) return cfg.max_position_embeddings;
  const int64_t original =
      s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings : cfg.max_position_embeddings;
  const double scaled = std::min(static_cast<double>(original) * s.factor, 1e15);
  return std::max(cfg.max_position_embeddings, static_cast<int64_t>(scaled));
}

double attention_cost_tokens(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden_size);
  // A sparse layer's MLP: the experts one token runs through, and the shared expert.
  const double mlp = c.moe() ? static_cast<double>(c.experts_per_token * c.moe_intermediate_size +
                                                   c.shared_expert_intermediate_size)
                             : static_cast<double>(c.intermediate_size);
  const double per_layer = h * static_cast<double>(c.q_size()) * 2 + h * static_cast<double>(c.kv_size()) * 2 +
                           3 * h * mlp;
  return per_layer / static_cast<double>(std::max<int64_t>(1, c.q_size()));
}

ModelConfig load_model_config(const std::string& dir_or_file) {
  std::string path = dir_or_file;
  if (path.size() < 5 || path.compare(path.size() - 5, 5, ".json") != 0) path += "/config.json";
  const auto text = read_file(path);
  if (!text) throw ConfigError(fmt::format("{}: cannot open the model config (is this a Hugging Face model directory?)", path));
  return parse_model_config(*text, path);
}

void validate(const ModelConfig& c, const std::string& where) {
  auto positive = [&](int64_t v, const char* key) {
    if (v <= 0) throw ConfigError(fmt::format("{}: {} must be > 0, got {}", where, key, v));
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.num_layers, "num_hidden_layers");
  positive(c.num_heads, "num_attention_heads");
  positive(c.num_kv_heads, "num_key_value_heads");
  positive(c.head_dim, "head_dim");
  if (c.num_heads % c.num_kv_heads != 0)
    throw ConfigError(fmt::format("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", where,
                                  c.num_heads, c.num_kv_heads));
  if (c.head_dim % 2 != 0) throw ConfigError(fmt::format("{}: head_dim {} must be even for RoPE", where, c.head_dim));
  if (!(c.rope_theta > 0)) throw ConfigError(fmt::format("{}: rope_theta must be > 0", where));
  if (!(c.rms_norm_eps > 0)) throw ConfigError(fmt::format("{}: rms_norm_eps must be > 0", where));
  if ((int64_t)c.layer_window.size() != c.num_layers)
    throw ConfigError(fmt::format("{}: {} layer windows for {} layers", where, c.layer_window.size(), c.num_layers));
  auto in_vocab = [&](int64_t id, const char* key) {
    if (id >= c.vocab_size) throw ConfigError(fmt::format("{}: {} {} is outside the vocabulary ({})", where, key, id, c.vocab_size));
  };
  in_vocab(c.bos_token_id, "bos_token_id");
  in_vocab(c.pad_token_id, "pad_token_id");
  for (int64_t e : c.eos_token_ids) in_vocab(e, "eos_token_id");
  if (c.moe()) {
    positive(c.experts_per_token, "num_experts_per_tok");
    positive(c.moe_intermediate_size, "moe_intermediate_size");
    positive(c.decoder_sparse_step, "decoder_sparse_step");
    if (c.experts_per_token > c.num_experts)
      throw ConfigError(fmt::format("{}: num_experts_per_tok {} exceeds the {} experts", where, c.experts_per_token,
                                    c.num_experts));
    if (c.num_experts > 4096) throw ConfigError(fmt::format("{}: {} experts (at most 4096)", where, c.num_experts));
    if (c.shared_expert_intermediate_size < 0)
      throw ConfigError(fmt::format("{}: shared_expert_intermediate_size must be >= 0", where));
    for (int64_t l : c.mlp_only_layers)
      if (l < 0 || l >= c.num_layers)
        throw ConfigError(fmt::format("{}: mlp_only_layers names layer {} of {}", where, l, c.num_layers));
  }
}

std::string to_hf_config_json(const ModelConfig& c, bool value_head) {
  static const char* kArch[] = {"Llama", "Qwen2", "Qwen3", "Mistral", "Qwen2Moe", "Qwen3Moe", "Mixtral"};
  const std::string arch = std::string(kArch[static_cast<int>(c.family)]) +
                           (value_head ? "ForSequenceClassification" : "ForCausalLM");
  json j;
  j["architectures"] = {arch};
  j["model_type"] = family_name(c.family);
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["initializer_range"] = c.initializer_range;
  j["torch_dtype"] = c.torch_dtype;
  if (c.family == Family::kLlama || c.family == Family::kMistral || c.family == Family::kQwen3Moe)
    j["attention_bias"] = c.attention_bias;
  if (c.family == Family::kQwen2Moe) j["qkv_bias"] = c.attention_bias;
  if (c.moe()) {
    j["num_experts_per_tok"] = c.experts_per_token;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    if (c.family == Family::kMixtral) {
      j["num_local_experts"] = c.num_experts;
    } else {
      j["num_experts"] = c.num_experts;
      j["moe_intermediate_size"] = c.moe_intermediate_size;
      j["norm_topk_prob"] = c.norm_topk_prob;
      j["decoder_sparse_step"] = c.decoder_sparse_step;
      j["mlp_only_layers"] = c.mlp_only_layers;
      if (c.family == Family::kQwen2Moe) j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
    }
  }
  // The 4.x spelling: every transformers version reads it.
  j["rope_theta"] = c.rope_theta;
  const RopeScaling& r = c.rope_scaling;
  if (r.type != "default") {
    json s{{"rope_type", r.type}, {"factor", r.factor}};
    if (r.original_max_position_embeddings > 0) s["original_max_position_embeddings"] = r.original_max_position_embeddings;
    if (r.type == "llama3") {
      s["low_freq_factor"] = r.low_freq_factor;
      s["high_freq_factor"] = r.high_freq_factor;
    }
    if (r.type == "yarn") {
      s["beta_fast"] = r.beta_fast;
      s["beta_slow"] = r.beta_slow;
      if (r.attention_factor > 0) s["attention_factor"] = r.attention_factor;
      if (!r.truncate) s["truncate"] = false;
    }
    j["rope_scaling"] = s;
  }
  int64_t window = 0;
  bool all_same = true;
  for (int64_t w : c.layer_window) {
    if (w > 0) window = w;
  }
  for (int64_t w : c.layer_window) all_same = all_same && w == window;
  if (c.family == Family::kMistral || c.family == Family::kMixtral) {
    TILLER_CHECK(all_same, "{} applies one sliding window to every layer", family_name(c.family));
    j["sliding_window"] = window > 0 ? json(window) : json(nullptr);
  } else if (c.family != Family::kLlama) {
    j["sliding_window"] = window > 0 ? json(window) : json(nullptr);
    j["use_sliding_window"] = window > 0;
    json types = json::array();
    for (int64_t w : c.layer_window) types.push_back(w > 0 ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["max_window_layers"] = c.num_layers;
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  else if (!c.eos_token_ids.empty()) j["eos_token_id"] = c.eos_token_ids;
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  if (value_head) {
    j["num_labels"] = 1;
    j["id2label"] = {{"0", "LABEL_0"}};
    j["label2id"] = {{"LABEL_0", 0}};
  }
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

namespace {
ModelConfig make(Family f, int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv,
                 double theta, bool tied, int64_t max_pos) {
  ModelConfig c;
  c.family = f;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv;
  c.head_dim = hidden / heads;
  c.rope_theta = theta;
  c.tie_word_embeddings = tied;
  c.max_position_embeddings = max_pos;
  c.attention_bias = f == Family::kQwen2 || f == Family::kQwen2Moe;
  c.qk_norm = f == Family::kQwen3 || f == Family::kQwen3Moe;
  c.layer_window.assign(layers, 0);
  c.torch_dtype = "bfloat16";
  return c;
}
}  // namespace

std::vector<std::string> preset_names() {
  return {"qwen2-0.5b", "qwen2-1.5b",     "qwen2-7b",       "qwen2-32b",   "qwen2-72b",   "tiny-llama",  "tiny-qwen2",
          "tiny-qwen3", "tiny-mistral",  "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral",
          "qwen3-30b-a3b", "qwen3-30b-a3b-8l", "qwen3-a3b-dense-8l"};
}

ModelConfig preset(const std::string& name) {
  ModelConfig c;
  if (name == "qwen2-0.5b") {
    c = make(Family::kQwen2, 151936, 896, 4864, 24, 14, 2, 1e6, true, 32768);
  } else if (name == "qwen2-1.5b") {
    c = make(Family::kQwen2, 151936, 1536, 8960, 28, 12, 2, 1e6, true, 32768);
  } else if (name == "qwen2-7b") {
    c = make(Family::kQwen2, 152064, 3584, 18944, 28, 28, 4, 1e6, false, 32768);
  } else if (name == "qwen2-32b") {  // Qwen2.5-32B's shape (32.8B parameters)
    c = make(Family::kQwen2, 152064, 5120, 27648, 64, 40, 8, 1e6, false, 32768);
  } else if (name == "qwen2-72b") {  // Qwen2.5-72B's shape (72.7B parameters)
    c = make(Family::kQwen2, 152064, 8192, 29568, 80, 64, 8, 1e6, false, 32768);
  } else if (name == "qwen3-30b-a3b" || name == "qwen3-30b-a3b-8l") {
    // The published Qwen3-30B-A3B (128 experts of 768, top 8), or its first 8 layers (5.6B
    // parameters: training on 2 GPUs, decoding on one).
    c = make(Family::kQwen3Moe, 151936, 2048, 6144, name == "qwen3-30b-a3b" ? 48 : 8, 32, 4, 1e6, false, 40960);
    c.head_dim = 128;
    c.num_experts = 128;
    c.experts_per_token = 8;
    c.moe_intermediate_size = 768;
    c.norm_topk_prob = true;
  } else if (name == "qwen3-a3b-dense-8l") {
    // A dense Qwen3 with qwen3-30b-a3b-8l's active parameters (its MLP as wide as the 8 experts a
    // token runs through: 8 x 768): the dense side of the mixture's decode comparison.
    c = make(Family::kQwen3, 151936, 2048, 6144, 8, 32, 4, 1e6, false, 40960);
    c.head_dim = 128;
  } else if (name == "tiny-llama") {
    c = make(Family::kLlama, 512, 64, 176, 2, 4, 2, 500000.0, false, 2048);
  } else if (name == "tiny-qwen2") {
    c = make(Family::kQwen2, 512, 64, 176, 2, 4, 2, 1e6, true, 2048);
  } else if (name == "tiny-qwen3") {
    c = make(Family::kQwen3, 512, 64, 176, 2, 4, 2, 1e6, false, 2048);
    c.head_dim = 32;  // Qwen3 decouples head_dim from hidden/heads
  } else if (name == "tiny-mistral") {
    c = make(Family::kMistral, 512, 64, 176, 2, 4, 1, 1e6, false, 2048);
  } else if (name == "tiny-qwen3-moe") {  // 8 experts of 48, top 2, renormalised
    c = make(Family::kQwen3Moe, 512, 64, 176, 2, 4, 2, 1e6, false, 2048);
    c.head_dim = 32;
    c.num_experts = 8;
    c.experts_per_token = 2;
    c.moe_intermediate_size = 48;
    c.norm_topk_prob = true;
  } else if (name == "tiny-qwen2-moe") {  // a shared expert, and layer 0 dense
    c = make(Family::kQwen2Moe, 512, 64, 176, 2, 4, 2, 1e6, true, 2048);
    c.num_experts = 6;
    c.experts_per_token = 2;
    c.moe_intermediate_size = 48;
    c.shared_expert_intermediate_size = 96;
    c.mlp_only_layers = {0};
  } else if (name == "tiny-mixtral") {
    c = make(Family::kMixtral, 512, 64, 96, 2, 4, 2, 1e6, false, 2048);
    c.num_experts = 4;
    c.experts_per_token = 2;
    c.moe_intermediate_size = 96;
    c.norm_topk_prob = true;
  } else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw ConfigError(fmt::format("unknown model preset '{}'; use one of: {}", name, names));
  }
  if (name.rfind("tiny-", 0) == 0) {
    c.torch_dtype = "float32";
    c.eos_token_ids = {c.vocab_size - 1};
  } else {
    c.eos_token_ids = {151643};
  }
  return c;
}

namespace {
// Every parameter, or with `active` only the experts a token runs through.
int64_t count_parameters(const ModelConfig& c, bool active) {
  const int64_t h = c.hidden_size;
  int64_t attn = h * c.q_size() + 2 * h * c.kv_size() + c.q_size() * h + 2 * h;  // q, k, v, o, two norms
  if (c.attention_bias) attn += c.q_size() + 2 * c.kv_size();
  if (c.qk_norm) attn += 2 * c.head_dim;
  int64_t n = c.vocab_size * h + h;
  if (!c.tie_word_embeddings) n += c.vocab_size * h;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    n += attn;
    if (!c.sparse_layer(i)) {
      n += 3 * h * c.intermediate_size;
      continue;
    }
    n += c.num_experts * h + 3 * h * c.moe_intermediate_size * (active ? c.experts_per_token : c.num_experts);
    if (c.shared_expert_intermediate_size > 0) n += 3 * h * c.shared_expert_intermediate_size + h;
  }
  return n;
}
}  // namespace

int64_t num_parameters(const ModelConfig& c) { return count_parameters(c, false); }
int64_t active_parameters(const ModelConfig& c) { return count_parameters(c, true); }

}  // namespace tiller::model
