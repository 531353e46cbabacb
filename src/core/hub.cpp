#include "tiller/core/hub.h"

#include <cctype>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller {
namespace {

namespace fs = std::filesystem;

bool name_chars(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return s != "." && s != "..";
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t b = 0;
  while (b < s.size() && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  return s.substr(b);
}

}  // namespace

std::optional<HubModel> parse_hub_id(const std::string& spec) {
  if (spec.empty() || spec[0] == '/' || spec[0] == '.' || spec[0] == '~') return std::nullopt;
  const size_t at = spec.find('@');
  const std::string repo = spec.substr(0, at);
  const size_t slash = repo.find('/');
  if (slash == std::string::npos || repo.find('/', slash + 1) != std::string::npos) return std::nullopt;
  if (!name_chars(repo.substr(0, slash)) || !name_chars(repo.substr(slash + 1))) return std::nullopt;
  std::error_code ec;
  if (fs::exists(spec, ec) || fs::exists(repo, ec)) return std::nullopt;  // a local folder of that name wins
  HubModel m{repo, at == std::string::npos ? "main" : spec.substr(at + 1)};
  if (m.revision.empty() || m.revision.find("..") != std::string::npos) return std::nullopt;
  return m;
}

std::string hub_cache_dir() {
  if (std::string d = env("HF_HUB_CACHE"); !d.empty()) return d;
  if (std::string d = env("HF_HOME"); !d.empty()) return d + "/hub";
  if (std::string d = env("XDG_CACHE_HOME"); !d.empty()) return d + "/huggingface/hub";
  return env("HOME") + "/.cache/huggingface/hub";
}

std::optional<std::string> find_hub_snapshot(const HubModel& model) {
  std::string folder = "models--" + model.repo;
  folder.replace(folder.find('/'), 1, "--");
  const fs::path repo = fs::path(hub_cache_dir()) / folder;
  std::error_code ec;
  if (!fs::is_directory(repo, ec)) return std::nullopt;
  std::string commit;
  if (const auto ref = read_file((repo / "refs" / model.revision).string())) {
    commit = trim(*ref);
  } else if (model.revision.size() == 40 &&
             model.revision.find_first_not_of("0123456789abcdef") == std::string::npos) {
    commit = model.revision;  // a commit given as the revision
  } else {
    return std::nullopt;
  }
  const fs::path snapshot = repo / "snapshots" / commit;
  if (commit.empty() || !fs::exists(snapshot / "config.json", ec)) return std::nullopt;
  return snapshot.string();
}

bool hub_offline() {
  std::string v = env("HF_HUB_OFFLINE");
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

namespace {

// The models the job loads, with their keys: enabled roles', and the engines' when set.
template <class Config, class Fn>
void for_each_model(Config& cfg, Fn&& fn) {
  fn(cfg.roles.actor.model, "roles.actor.model");
  if (cfg.roles.critic.enabled) fn(cfg.roles.critic.model, "roles.critic.model");
  if (cfg.roles.ref.enabled) fn(cfg.roles.ref.model, "roles.ref.model");
  if (cfg.roles.reward.enabled) fn(cfg.roles.reward.model, "roles.reward.model");
  fn(cfg.engines.model, "engines.model");
}

}  // namespace

std::vector<HubModelRef> hub_models(const JobConfig& cfg) {
  std::vector<HubModelRef> out;
  for_each_model(cfg, [&](const std::string& model, const char* key) {
    if (const auto id = parse_hub_id(model)) out.push_back({key, *id});
  });
  return out;
}

std::string resolve_hub_model(const std::string& spec, const std::string& key, bool strict) {
  const auto id = parse_hub_id(spec);
  if (!id) return spec;
  if (const auto snapshot = find_hub_snapshot(*id)) return *snapshot;
  if (strict) {
    std::error_code ec;
    throw ConfigError(fmt::format(
          "{} = '{}': no such folder (relative paths start from {}), and as a Hugging Face hub id it is not in the "
          "cache ({}; HF_HUB_CACHE or HF_HOME set it) at revision {}{}; give an existing folder, or download it on "
          "every node first: huggingface-cli download {} --revision {}",
          key, spec, fs::current_path(ec).string(), hub_cache_dir(), id->revision,
          hub_offline() ? " (HF_HUB_OFFLINE is set, so tiller does not download it)" : "", id->repo, id->revision));
  }
  return spec;
}

void resolve_hub_models(JobConfig& cfg, bool strict) {
  for_each_model(cfg, [&](std::string& model, const char* key) { model = resolve_hub_model(model, key, strict); });
}

}  // namespace tiller
