#include "controller/step_trace.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller::rollout {
namespace {

using json = nlohmann::ordered_json;

// The longest run of steps a profile_steps range may name.
constexpr int64_t kMaxProfiledRange = 100000;

}  // namespace

std::set<int64_t> parse_steps(const std::string& spec) {
  std::set<int64_t> out;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    const std::string part = spec.substr(pos, end - pos);
    try {
      const size_t dash = part.find('-');
      if (dash == std::string::npos) {
        out.insert(std::stoll(part));
      } else {
        const int64_t a = std::stoll(part.substr(0, dash)), b = std::stoll(part.substr(dash + 1));
        if (b < a || b - a > kMaxProfiledRange) throw std::invalid_argument("range");
        for (int64_t s = a; s <= b; ++s) out.insert(s);
      }
    } catch (const std::logic_error&) {
      throw ConfigError(fmt::format("logging.profile_steps = '{}': use step numbers like \"3\", \"3,5\" or \"3-5\"",
                                    spec));
    }
    pos = end + 1;
  }
  return out;
}

StepTrace::StepTrace(const std::string& profile_steps, std::string path, std::vector<std::string> labels,
                     int controller)
    : steps_(parse_steps(profile_steps)), path_(std::move(path)), labels_(std::move(labels)), controller_(controller) {}

void StepTrace::span(int64_t step, const std::string& name, int rank, double begin_us, double end_us) {
  if (!profiled(step)) return;
  const json e = {{"name", name},         {"ph", "X"}, {"ts", begin_us},
                  {"dur", end_us - begin_us}, {"pid", rank < 0 ? controller_ : rank},
                  {"tid", 0},             {"args", {{"step", step}}}};
  events_.push_back(e.dump());
}

void StepTrace::counter(int64_t step, const std::string& name, int rank, double time_us,
                        const std::vector<std::pair<std::string, double>>& values) {
  if (!profiled(step)) return;
  json args = json::object();
  for (const auto& [k, v] : values) args[k] = v;
  const json e = {{"name", name}, {"ph", "C"}, {"ts", time_us}, {"pid", rank < 0 ? controller_ : rank}, {"args", args}};
  events_.push_back(e.dump());
}

void StepTrace::write() const {
  std::string out = "{\"traceEvents\":[";
  bool first = true;
  for (size_t r = 0; r < labels_.size(); ++r) {
    const json m = {{"name", "process_name"}, {"ph", "M"}, {"pid", r},
                    {"args", {{"name", fmt::format("rank {} {}", r, labels_[r])}}}};
    out += (first ? "" : ",") + m.dump();
    first = false;
  }
  for (const auto& e : events_) out += "," + e;
  out += "],\"displayTimeUnit\":\"ms\"}\n";
  write_file_atomic(path_, out);
}

StepOutputs::StepOutputs(const std::string& jsonl, const std::string& tensorboard_dir, const std::string& records,
                         bool record_tokens)
    : jsonl_(std::make_unique<JsonlWriter>(jsonl)),
      tensorboard_(std::make_unique<TensorBoardWriter>(tensorboard_dir)),
      records_(records.empty() ? nullptr : std::make_unique<JsonlWriter>(records)),
      record_tokens_(record_tokens) {}

void StepOutputs::write(int64_t step, const Metrics& metrics) {
  jsonl_->write(step, metrics);
  tensorboard_->scalars(step, metrics);
}

void StepOutputs::record(const StepBatch& batch, uint64_t trained_version,
                         const std::function<int64_t(int64_t)>& line_of) {
  if (!records_) return;
  const Rollout& ro = batch.ro;
  for (int64_t s = 0; s < ro.size(); ++s) {
    const StepBatch::Group& g = batch.groups[static_cast<size_t>(ro.prompt[s])];
    json r;
    r["step"] = batch.step;
    r["event"] = "trained";
    r["ordinal"] = g.ordinal;
    r["prompt_line"] = line_of(g.dataset_index);
    r["dataset_index"] = g.dataset_index;
    r["sample"] = ro.sample[s];
    r["dispatch_version"] = g.dispatch_version;
    r["trained_version"] = trained_version;
    const uint64_t oldest = ro.oldest_version(s);
    r["lag"] = trained_version > oldest ? trained_version - oldest : 0;
    json runs = json::array();
    for (int64_t i = ro.run_offset[s]; i < ro.run_offset[s + 1]; ++i)
      runs.push_back({ro.run_start[static_cast<size_t>(i)], ro.run_version[static_cast<size_t>(i)]});
    r["version_runs"] = runs;  // [first response token, version]
    r["response_len"] = ro.response_len[s];
    r["score"] = ro.score[static_cast<size_t>(s)];
    if (ro.layout.turns) {  // multi-turn: each model turn's last response token and its reward
      json turns = json::array();
      for (int64_t i = ro.turn_offset[s]; i < ro.turn_offset[s + 1]; ++i)
        turns.push_back({ro.turn_end[static_cast<size_t>(i)], ro.turn_reward[static_cast<size_t>(i)]});
      r["turns"] = turns;
      r["model_tokens"] = ro.model_tokens(s);
    }
    if (record_tokens_) {
      if (ro.layout.turns)
        r["loss_mask"] = std::vector<int>(ro.loss_mask.begin() + ro.resp_offset[s],
                                          ro.loss_mask.begin() + ro.resp_offset[s] + ro.response_len[s]);
      r["prompt_ids"] = std::vector<int32_t>(ro.tokens.begin() + ro.seq_offset[s],
                                             ro.tokens.begin() + ro.seq_offset[s] + ro.prompt_len[s]);
      r["response_ids"] = std::vector<int32_t>(ro.tokens.begin() + ro.seq_offset[s] + ro.prompt_len[s],
                                               ro.tokens.begin() + ro.seq_offset[s] + ro.seq_len(s));
      r["engine_logprobs"] = std::vector<float>(ro.engine_logp.begin() + ro.resp_offset[s],
                                                ro.engine_logp.begin() + ro.resp_offset[s] + ro.response_len[s]);
      // The actor's scored log-probs of the same tokens (the proximal policy, trained_version's
      // weights): equal to engine_logprobs bit for bit where the engine drew with those weights,
      // under algo.logprob_match = bitwise.
      r["actor_logprobs"] = std::vector<float>(ro.logp.begin() + ro.resp_offset[s],
                                               ro.logp.begin() + ro.resp_offset[s] + ro.response_len[s]);
    }
    records_->append(r.dump());
  }
  for (const auto& d : batch.dropped) {
    json r;
    r["step"] = batch.step;
    r["event"] = d.reason == "filtered" ? "filtered" : "dropped_stale";
    r["ordinal"] = d.ordinal;
    r["prompt_line"] = line_of(d.dataset_index);
    r["dataset_index"] = d.dataset_index;
    r["dispatch_version"] = d.dispatch_version;
    if (d.oldest_version != UINT64_MAX) r["oldest_version"] = d.oldest_version;
    records_->append(r.dump());
  }
}

}  // namespace tiller::rollout
