#include "controller/checkpoint_manager.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"
#include "tiller/core/file_system.h"
#include "tiller/core/files.h"

namespace tiller::rollout {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

constexpr const char* kFormat = "tiller-controller-2";
constexpr const char* kFormatV1 = "tiller-controller-1";  // before the asynchronous pipeline: nothing in flight
constexpr size_t kMaxStepDigits = 15;

}  // namespace

std::string ControllerState::to_json() const {
  json st;
  st["format"] = kFormat;
  st["step"] = step;
  st["weight_version"] = weight_version;
  st["actor_updates"] = actor_updates;
  st["critic_updates"] = critic_updates;
  st["dataset"] = {{"epoch", dataset_epoch}, {"position", dataset_position}, {"size", dataset_size}};
  st["kl_coef"] = kl_coef;
  st["reward_moments"] = {{"mean", reward_mean}, {"m2", reward_m2}, {"count", reward_count}};
  json pending = json::array();
  for (const auto& p : outstanding) pending.push_back({{"ordinal", p.ordinal}, {"dataset_index", p.dataset_index}});
  st["pipeline"] = {{"next_ordinal", next_ordinal}, {"outstanding", pending}};
  return st.dump(2) + "\n";
}

ControllerState ControllerState::from_json(const std::string& text, const std::string& path) {
  ControllerState s;
  try {
    const json st = json::parse(text);
    const std::string format = st.value("format", "");
    if (format != kFormat && format != kFormatV1)
      throw IoError(fmt::format("{}: not a tiller controller state (format '{}')", path, format));
    s.step = st.at("step").get<int64_t>();
    s.weight_version = st.at("weight_version").get<uint64_t>();
    s.actor_updates = st.at("actor_updates").get<int64_t>();
    s.critic_updates = st.at("critic_updates").get<int64_t>();
    s.dataset_epoch = st.at("dataset").at("epoch").get<int64_t>();
    s.dataset_position = st.at("dataset").at("position").get<int64_t>();
    s.dataset_size = st.at("dataset").at("size").get<int64_t>();
    s.kl_coef = st.at("kl_coef").get<double>();
    s.reward_mean = st.at("reward_moments").at("mean").get<double>();
    s.reward_m2 = st.at("reward_moments").at("m2").get<double>();
    s.reward_count = st.at("reward_moments").at("count").get<int64_t>();
    if (format == kFormat) {
      s.next_ordinal = st.at("pipeline").at("next_ordinal").get<int64_t>();
      for (const auto& p : st.at("pipeline").at("outstanding"))
        s.outstanding.push_back({p.at("ordinal").get<int64_t>(), p.at("dataset_index").get<int64_t>()});
    }
  } catch (const json::exception& e) {
    throw IoError(fmt::format("{}: not a valid controller state ({}); remove this checkpoint to resume from the one "
                              "before",
                              path, e.what()));
  }
  if (s.step < 0 || s.next_ordinal < 0 || s.dataset_size < 0)
    throw IoError(fmt::format("{}: negative counts in the controller state", path));
  return s;
}

CheckpointManager::CheckpointManager(std::string root, int64_t keep_last)
    : root_(std::move(root)), keep_last_(std::max<int64_t>(1, keep_last)) {}

std::string CheckpointManager::dir(int64_t step) const { return fmt::format("{}/step_{:06d}", root_, step); }

std::vector<CheckpointManager::Entry> CheckpointManager::list() const {
  std::vector<Entry> out;
  std::error_code ec;
  if (!enabled() || !fs::is_directory(root_, ec)) return out;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.find('.') != std::string::npos) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || digits.size() > kMaxStepDigits ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      throw ConfigError(fmt::format("checkpoint.dir = {}: '{}' is not a checkpoint name (step_ and a step number); "
                                    "move it out of the checkpoint directory",
                                    root_, name));
    if (!fs::exists(e.path() / "controller.json", ec)) continue;
    out.push_back({std::stoll(digits), e.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.step < b.step; });
  return out;
}

std::string CheckpointManager::begin(int64_t step) const {
  const std::string d = dir(step);
  FileSystem& fsys = FileSystem::current();
  fsys.remove_file(d + "/controller.json");  // incomplete until commit
  fsys.make_dirs(d);
  return d;
}

void CheckpointManager::commit(int64_t step, const ControllerState& state) const {
  write_file_atomic(dir(step) + "/controller.json", state.to_json());
  auto all = list();
  while (static_cast<int64_t>(all.size()) > keep_last_) {
    remove_tree(all.front().dir);
    all.erase(all.begin());
  }
}

std::vector<std::string> CheckpointManager::remove_incomplete() const {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!enabled() || !fs::is_directory(root_, ec)) return removed;
  list();  // refuses a stray step_* name before anything is removed
  std::vector<fs::path> doomed;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.find('.') != std::string::npos || !e.is_directory(ec)) continue;
    if (!fs::exists(e.path() / "controller.json", ec)) doomed.push_back(e.path());
  }
  std::sort(doomed.begin(), doomed.end());
  for (const auto& p : doomed) {
    remove_tree(p.string());
    removed.push_back(p.filename().string());
  }
  if (!removed.empty()) fsync_dir(root_);
  return removed;
}

std::optional<std::pair<CheckpointManager::Entry, ControllerState>> CheckpointManager::latest() const {
  const auto all = list();
  if (all.empty()) return std::nullopt;
  const Entry& e = all.back();
  const std::string path = e.dir + "/controller.json";
  const auto text = read_file(path);
  if (!text) throw IoError(fmt::format("{}: cannot be read", path));
  return std::make_pair(e, ControllerState::from_json(*text, path));
}

}  // namespace tiller::rollout
