#include "controller/step_trace.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "python/tracking.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller::controller {
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

StepOutputs::StepOutputs(StepOutputOptions o)
    : o_(std::move(o)),
      jsonl_(std::make_unique<JsonlWriter>(o_.metrics_jsonl)),
      tensorboard_(std::make_unique<TensorBoardWriter>(o_.tensorboard_dir)),
      records_(o_.records.empty() ? nullptr : std::make_unique<JsonlWriter>(o_.records)),
      samples_(o_.samples_per_step > 0 ? std::make_unique<JsonlWriter>(o_.samples_jsonl) : nullptr) {}

namespace {

std::vector<int64_t> ids_of(const Rollout& ro, int64_t from, int64_t n) {
  return std::vector<int64_t>(ro.tokens.begin() + from, ro.tokens.begin() + from + n);
}

// A cell of a Markdown table.
std::string cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += "\\|";
    else if (c == '\n') out += "<br>";
    else out += c;
  }
  return out;
}

}  // namespace

void StepOutputs::samples(const StepBatch& batch, const std::function<int64_t(int64_t)>& line_of) {
  const Rollout& ro = batch.ro;
  std::vector<int64_t> order(static_cast<size_t>(ro.size()));
  std::iota(order.begin(), order.end(), 0);
  const auto key = [&](int64_t s) {
    return std::pair(batch.groups[static_cast<size_t>(ro.prompt[s])].ordinal, ro.sample[s]);
  };
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
  order.resize(std::min<size_t>(order.size(), static_cast<size_t>(o_.samples_per_step)));
  const auto text = [&](const std::vector<int64_t>& ids) { return o_.decode ? o_.decode(ids) : std::string(); };
  // `ids` as text under `key`, or as ids under key_ids without a decoder.
  const auto put = [&](json& o, const std::string& key, const std::vector<int64_t>& ids) {
    if (o_.decode) o[key] = text(ids);
    else o[key + "_ids"] = ids;
  };
  json rows = json::array();
  std::string table = "| prompt line | sample | prompt | response | reward | advantage |\n|---|---|---|---|---|---|\n";
  for (int64_t s : order) {
    const StepBatch::Group& g = batch.groups[static_cast<size_t>(ro.prompt[s])];
    const int64_t p0 = ro.seq_offset[s], r0 = p0 + ro.prompt_len[s], t0 = ro.resp_offset[s];
    // The advantage of the sample's trained tokens (the model's, in multi-turn runs), their mean.
    double adv = 0;
    int64_t trained = 0;
    for (int64_t t = 0; t < ro.response_len[s]; ++t) {
      if (ro.layout.turns && ro.loss_mask[static_cast<size_t>(t0 + t)] == 0) continue;
      adv += ro.advantages.empty() ? 0.0 : ro.advantages[static_cast<size_t>(t0 + t)];
      ++trained;
    }
    json j;
    j["step"] = batch.step;
    j["prompt_line"] = line_of(g.dataset_index);
    j["sample"] = ro.sample[s];
    const std::vector<int64_t> prompt = ids_of(ro, p0, ro.prompt_len[s]), response = ids_of(ro, r0, ro.response_len[s]);
    put(j, "prompt", prompt);
    put(j, "response", response);
    j["reward"] = ro.score[static_cast<size_t>(s)];
    j["advantage"] = trained > 0 ? adv / static_cast<double>(trained) : 0.0;
    j["response_len"] = ro.response_len[s];
    j["truncated"] = ro.truncated[static_cast<size_t>(s)] != 0;
    if (ro.layout.turns) {
      // Each model turn (a run of trained tokens), what answered it (the run of observation
      // tokens after it) and its reward.
      json turns = json::array();
      int64_t t = 0, turn = 0;
      while (t < ro.response_len[s]) {
        const int64_t start = t;
        while (t < ro.response_len[s] && ro.loss_mask[static_cast<size_t>(t0 + t)] == 1) ++t;
        const int64_t obs = t;
        while (t < ro.response_len[s] && ro.loss_mask[static_cast<size_t>(t0 + t)] == 0) ++t;
        json u;
        put(u, "model", ids_of(ro, r0 + start, obs - start));
        put(u, "observation", ids_of(ro, r0 + obs, t - obs));
        const int64_t k = ro.turn_offset[s] + turn;
        if (k < ro.turn_offset[s + 1]) u["reward"] = ro.turn_reward[static_cast<size_t>(k)];
        turns.push_back(u);
        ++turn;
      }
      j["turns"] = turns;
    }
    samples_->append(j.dump(-1, ' ', false, json::error_handler_t::replace));
    table += fmt::format("| {} | {} | {} | {} | {:.4f} | {:.4f} |\n", j["prompt_line"].get<int64_t>(), ro.sample[s],
                         cell(text(prompt)), cell(text(response)), ro.score[static_cast<size_t>(s)],
                         j["advantage"].get<double>());
    rows.push_back(std::move(j));
  }
  if (!order.empty() && o_.decode) tensorboard_->text(batch.step, "samples", table);
  if (o_.tracking && !order.empty()) o_.tracking->samples(batch.step, rows.dump(-1, ' ', false, json::error_handler_t::replace));
}

void StepOutputs::write(int64_t step, const Metrics& metrics) {
  jsonl_->write(step, metrics);
  tensorboard_->scalars(step, metrics);
  if (o_.tracking) o_.tracking->log(step, metrics);
}

void StepOutputs::record(const StepBatch& batch, uint64_t trained_version,
                         const std::function<int64_t(int64_t)>& line_of) {
  if (samples_) samples(batch, line_of);
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
    if (o_.record_text && o_.decode) {
      r["prompt_text"] = o_.decode(ids_of(ro, ro.seq_offset[s], ro.prompt_len[s]));
      r["response_text"] = o_.decode(ids_of(ro, ro.seq_offset[s] + ro.prompt_len[s], ro.response_len[s]));
    }
    if (o_.record_tokens) {
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
    records_->append(r.dump(-1, ' ', false, json::error_handler_t::replace));
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

}  // namespace tiller::controller
