#include "zero/run_checkpoints.h"

#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"

namespace tiller::zero {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* kFormat = "tiller-controller-2";
constexpr const char* kFormatV1 = "tiller-controller-1";  // before the asynchronous pipeline: nothing in flight

}  // namespace

std::string RunState::to_json() const {
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

RunState RunState::from_json(const std::string& text, const std::string& path) {
  RunState s;
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

RunCheckpoints::RunCheckpoints(std::string root, int64_t keep_last) : dirs_(std::move(root), keep_last) {}

std::vector<RunCheckpoints::Entry> RunCheckpoints::list() const { return dirs_.list(); }

void RunCheckpoints::commit(int64_t step, const RunState& state) const { dirs_.commit(step, state.to_json()); }

std::optional<std::pair<RunCheckpoints::Entry, RunState>> RunCheckpoints::latest() const {
  const auto l = dirs_.latest();
  if (!l) return std::nullopt;
  return std::make_pair(l->entry, RunState::from_json(l->marker_text, l->marker_path));
}

}  // namespace tiller::zero
