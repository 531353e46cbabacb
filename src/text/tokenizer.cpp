#include "tiller/text/tokenizer.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/model/model_config.h"

namespace tiller::text {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_or_throw(const fs::path& p) {
  auto text = read_file(p.string());
  if (!text) throw IoError(fmt::format("{}: cannot open", p.string()));
  return *text;
}

// tokenizer_config.json names special tokens as strings or as {"content": ...} objects.
std::optional<std::string> token_text(const json& cfg, const char* key) {
  if (!cfg.contains(key) || cfg[key].is_null()) return std::nullopt;
  if (cfg[key].is_string()) return cfg[key].get<std::string>();
  if (cfg[key].is_object() && cfg[key].contains("content")) return cfg[key]["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir) {
  const fs::path d(dir);
  std::unique_ptr<Tokenizer> tok;
  if (fs::exists(d / "tokenizer.json")) {
    tok = make_bpe_tokenizer(read_or_throw(d / "tokenizer.json"), (d / "tokenizer.json").string());
  } else if (fs::exists(d / "tokenizer.model")) {
    tok = make_sentencepiece_tokenizer((d / "tokenizer.model").string());
  } else {
    throw IoError(fmt::format("{}: no tokenizer.json or tokenizer.model", dir));
  }
  const fs::path cfg_path = d / "tokenizer_config.json";
  if (fs::exists(cfg_path)) {
    json cfg;
    try {
      cfg = json::parse(read_or_throw(cfg_path));
    } catch (const json::exception& e) {
      throw ConfigError(fmt::format("{}: not valid JSON ({})", cfg_path.string(), e.what()));
    }
    auto resolve = [&](const char* key, std::optional<int64_t>& slot) {
      auto text = token_text(cfg, key);
      if (!text) return;
      auto id = tok->token_to_id(*text);
      if (!id) throw ConfigError(fmt::format("{}: {} '{}' is not in the vocabulary", cfg_path.string(), key, *text));
      slot = id;
    };
    resolve("bos_token", tok->bos_id);
    resolve("eos_token", tok->eos_id);
    resolve("pad_token", tok->pad_id);
  }
  return tok;
}

std::vector<int64_t> eos_token_ids(const std::string& dir, const model::ModelConfig& cfg, const Tokenizer& tok) {
  std::vector<int64_t> ids = cfg.eos_token_ids;
  const fs::path gen = fs::path(dir) / "generation_config.json";
  if (fs::exists(gen)) {
    nlohmann::json g;
    try {
      g = nlohmann::json::parse(read_file(gen.string()).value_or(""));
    } catch (const nlohmann::json::exception& e) {
      throw ConfigError(fmt::format("{}: not valid JSON ({})", gen.string(), e.what()));
    }
    if (g.contains("eos_token_id") && g["eos_token_id"].is_number_integer()) ids.push_back(g["eos_token_id"]);
    if (g.contains("eos_token_id") && g["eos_token_id"].is_array())
      for (const auto& e : g["eos_token_id"]) ids.push_back(e.get<int64_t>());
  }
  if (tok.eos_id) ids.push_back(*tok.eos_id);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace tiller::text
