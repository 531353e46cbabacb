#include "controller/evaluator.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/controller/prompt_source.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/core/logging.h"
#include "tiller/text/tokenizer.h"

namespace tiller::controller {
namespace {

namespace fs = std::filesystem;

// The rewards of evaluation: eval.reward_rule when set, else the job's.
JobRewards eval_rewards(const JobConfig& cfg, std::function<std::string(const std::vector<int64_t>&)> decode) {
  if (cfg.eval.reward_rule.empty()) return make_job_rewards(cfg, std::move(decode));
  JobConfig rc = cfg;
  rc.reward.type = RewardType::kRule;
  rc.reward.rule = cfg.eval.reward_rule;
  try {
    return make_job_rewards(rc, std::move(decode));
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("eval.reward_rule: {}", e.what()));
  }
}

// Evaluation seeds: prompt i's samples draw with kEvalSeedBase + run.seed x kSeedStride + i x
// kPromptStride + j, apart from the rollouts' (collector.cpp) and the same at every evaluation, so
// that two evaluations differ only by the weights. kPromptStride is above eval.n_samples' bound.
constexpr uint64_t kEvalSeedBase = 0x5eed0000ull, kSeedStride = 1000003ull, kPromptStride = 1024ull;

constexpr int kUnavailable = 14;  // grpc::StatusCode::UNAVAILABLE: the engine drains

// The most samples one evaluation scores (prompts x (greedy + n_samples)).
constexpr int64_t kMaxEvalSamples = 4 << 20;

// A sample's id for the batched reward: prompt and sample (0: the greedy one, j + 1: sample j).
uint64_t reward_id(int64_t prompt, int64_t sample, int64_t k) {
  return static_cast<uint64_t>(prompt) * static_cast<uint64_t>(k + 1) + static_cast<uint64_t>(sample + 1);
}

}  // namespace

Evaluator::Evaluator(const JobConfig& cfg, const text::Tokenizer& tok, EngineSet& engines,
                     std::vector<int64_t> stop_ids, const Clock& clock)
    : cfg_(cfg), engines_(engines), clock_(clock) {
  data::DatasetOptions d = job_dataset_options(cfg, tok);
  d.shuffle = false;
  d.max_samples = cfg.eval.max_prompts;
  try {
    data_ = std::make_unique<data::PromptDataset>(cfg.eval.prompts, tok, d);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("eval.prompts: {}", e.what()));
  }
  // Each evaluation keeps a score for every sample: prompts x samples has a bound of its own.
  const int64_t per_prompt = (cfg.eval.greedy ? 1 : 0) + cfg.eval.n_samples;
  if (data_->size() > kMaxEvalSamples / std::max<int64_t>(1, per_prompt))
    throw ConfigError(fmt::format("eval: {} prompts of {} x {} samples each is over {} samples an evaluation; lower "
                                  "eval.max_prompts or eval.n_samples",
                                  data_->size(), cfg.eval.prompts, per_prompt, kMaxEvalSamples));
  const text::Tokenizer* t = &tok;
  decode_ = [t](const std::vector<int64_t>& ids) { return t->decode(ids, true); };
  rewards_ = eval_rewards(cfg, decode_);
  greedy_.greedy = true;
  greedy_.max_new_tokens = cfg.eval.max_new_tokens > 0 ? cfg.eval.max_new_tokens : cfg.rollout.max_new_tokens;
  greedy_.stop_token_ids = std::move(stop_ids);
  sampled_ = greedy_;
  sampled_.greedy = false;
  sampled_.temperature = cfg.eval.temperature;
  sampled_.top_p = cfg.eval.top_p;
  greedy_.validate();
  sampled_.validate();
  file_source_ = fs::path(cfg.eval.prompts).stem().string();
  log::info("eval: {} prompts of {}{}{} after every {} steps{}", data_->size(), cfg.eval.prompts,
            cfg.eval.greedy ? ", greedy" : "",
            cfg.eval.n_samples > 0 ? fmt::format(", {} samples at temperature {}", cfg.eval.n_samples, cfg.eval.temperature)
                                   : std::string(),
            cfg.eval.every_steps, cfg.eval.before_train ? " and before training" : "");
}

Evaluator::~Evaluator() = default;

int64_t Evaluator::prompts() const { return data_->size(); }

bool Evaluator::due(int64_t step, bool last) const {
  if (step == 0) return cfg_.eval.before_train;
  return cfg_.eval.every_steps > 0 && (step % cfg_.eval.every_steps == 0 || last);
}

std::string Evaluator::source_of(int64_t prompt) const {
  const std::string& s = data_->at(prompt).data_source;
  return s.empty() ? file_source_ : s;
}

bool Evaluator::usable(size_t e) const { return !engines_.retired(e) && !draining_[e]; }

size_t Evaluator::least_busy() const {
  size_t e = in_flight_.size();
  for (size_t i = 0; i < in_flight_.size(); ++i)
    if (usable(i) && (e == in_flight_.size() || in_flight_[i] < in_flight_[e])) e = i;
  return e;
}

void Evaluator::send_more() {
  const int64_t cap = std::max<int64_t>(1, cfg_.engines.max_num_seqs);
  move_off();
  while (next_ < queue_.size()) {
    const size_t e = least_busy();
    if (e == in_flight_.size()) throw CommError("evaluation: no engine is left in the job");
    const auto [prompt, greedy] = queue_[next_];
    const int64_t n = greedy ? 1 : cfg_.eval.n_samples;
    if (in_flight_[e] > 0 && in_flight_[e] + n > cap) return;  // every engine is full
    engine::Request r;
    r.id = next_id_++;
    r.prompt = data_->at(prompt).tokens;
    r.n = n;
    r.params = greedy ? greedy_ : sampled_;
    r.params.seed = kEvalSeedBase + static_cast<uint64_t>(cfg_.run.seed) * kSeedStride +
                    static_cast<uint64_t>(prompt) * kPromptStride;
    const uint64_t id = r.id;
    live_[id] = Request{prompt, greedy, static_cast<int>(e), n, std::move(r), std::vector<uint8_t>(static_cast<size_t>(n), 0)};
    ++next_;
    if (!submit(e, live_[id])) move_off();
  }
}

bool Evaluator::submit(size_t e, const Request& r) {
  if (in_flight_[e] == 0) progress_[e] = clock_.now();
  in_flight_[e] += r.owed;
  try {
    engines_.submit(e, r.request, version_);
  } catch (const CommError& err) {  // its stream broke: a standalone engine leaves (move_off sends it on)
    if (!engines_.retire(e, fmt::format("{}: {}", engines_.name(e), err.what()))) throw;
    return false;
  }
  return true;
}

void Evaluator::move(Request& r) {
  const size_t dest = least_busy();
  if (dest == in_flight_.size())
    throw CommError(fmt::format("evaluation: no engine is left to take the requests of {}, which left the job or drains",
                                engines_.name(static_cast<size_t>(r.engine))));
  in_flight_[static_cast<size_t>(r.engine)] -= r.owed;
  r.engine = static_cast<int>(dest);
  r.owed = r.request.n;  // the whole request again, its seed as before
  last_progress_ = clock_.now();
  submit(dest, r);
}

void Evaluator::move_off() {
  if (retired_count() == retired_seen_) return;  // none left since the last look
  std::map<size_t, std::pair<int64_t, int64_t>> moved;  // engine that left -> requests, samples owed
  // Again while a move found its engine gone too; each round retires one more, so it ends.
  for (bool again = true; again;) {
    again = false;
    for (auto& [id, r] : live_) {
      const auto e = static_cast<size_t>(r.engine);
      if (!engines_.retired(e)) continue;
      auto& [requests, samples] = moved[e];
      ++requests;
      for (uint8_t b : r.back) samples += b ? 0 : 1;
      move(r);
      again = again || engines_.retired(static_cast<size_t>(r.engine));
    }
  }
  retired_seen_ = retired_count();
  for (const auto& [e, m] : moved)
    log::warn("evaluation: {} request(s) ({} samples) of {} move to the {} engine(s) left", m.first, m.second,
              engines_.name(e), engines_.live_count());
}

void Evaluator::check_progress(int64_t step) {
  const auto now = clock_.now();
  for (size_t e = 0; e < in_flight_.size(); ++e) {
    if (engines_.retired(e) || in_flight_[e] <= 0 || seconds_between(progress_[e], now) <= cfg_.timeouts.generate_s)
      continue;
    const std::string why = fmt::format(
        "evaluation after step {}: {} has {} samples in flight and returned none for {:.0f} s (timeouts.generate_s); "
        "{} of {} samples of {} are in",
        step, engines_.name(e), in_flight_[e], seconds_between(progress_[e], now), returned_, expected_,
        cfg_.eval.prompts);
    if (!engines_.retire(e, why)) throw TimeoutError(why);  // standalone engines: its requests move
  }
  if (seconds_between(last_progress_, now) > cfg_.timeouts.generate_s)  // whatever holds them back
    throw TimeoutError(fmt::format("evaluation after step {}: no sample came back for {:.0f} s "
                                   "(timeouts.generate_s); {} of {} samples of {} are in",
                                   step, seconds_between(last_progress_, now), returned_, expected_, cfg_.eval.prompts));
}

void Evaluator::take(Completion& c) {
  const engine::ClientResult& res = c.result;
  auto it = live_.find(res.sample.request_id);
  TILLER_CHECK(it != live_.end(), "{} answered evaluation request {}, which is not in flight", engines_.name(static_cast<size_t>(c.engine)),
               res.sample.request_id);
  Request& live = it->second;
  const auto e = static_cast<size_t>(c.engine);
  if (live.engine != c.engine) return;  // moved off an engine that left: the new one sends every sample
  const data::Prompt& p = data_->at(live.prompt);
  if (res.error_code == kUnavailable && engines_.elastic()) {  // sent before its drain's notice came
    draining_[e] = 1;
    move(live);
    return;
  }
  if (res.error_code != 0)
    throw Error(fmt::format("{} refused the evaluation prompt {} line {}: {}", engines_.name(e), cfg_.eval.prompts,
                            p.line, res.error));
  if (res.sample.finish_reason == "abort")
    throw Error(fmt::format("{} aborted the evaluation of {} line {}", engines_.name(e), cfg_.eval.prompts, p.line));
  in_flight_[e] -= 1;
  progress_[e] = last_progress_ = clock_.now();
  const auto index = static_cast<size_t>(res.sample.sample);
  TILLER_CHECK(index < live.back.size(), "{} answered sample {} of evaluation request {} of {} samples", engines_.name(e),
               res.sample.sample, res.sample.request_id, live.back.size());
  const bool repeat = live.back[index] != 0;
  live.back[index] = 1;
  const int64_t prompt = live.prompt;
  const bool greedy = live.greedy;
  if (--live.owed <= 0) live_.erase(it);
  if (repeat) return;
  ++returned_;
  Sample s;
  s.tokens = static_cast<int64_t>(res.sample.tokens.size());
  s.finish_reason = res.sample.finish_reason;
  if (rewards_.sources.rule) s.reward = rewards_.sources.rule(p, res.sample);
  if (rewards_.sources.batched) {
    reward::RewardSample rs;
    rs.id = reward_id(prompt, greedy ? -1 : res.sample.sample, cfg_.eval.n_samples);
    rs.prompt = p.text;
    rs.response = decode_(res.sample.tokens);
    rs.label = p.label;
    rs.label_is_json = p.label_is_json;
    rs.data_source = p.data_source;
    rs.extra_info = p.extra_info;
    rs.finish_reason = res.sample.finish_reason;
    rs.prompt_index = static_cast<uint64_t>(p.line);
    rs.sample_index = static_cast<uint32_t>(res.sample.sample);
    rs.response_tokens = s.tokens;
    rewards_.sources.batched->add(std::move(rs));
  }
  if (keep_[static_cast<size_t>(prompt)]) s.ids = res.sample.tokens;
  if (greedy) {
    greedy_samples_[static_cast<size_t>(prompt)] = std::move(s);
  } else {
    sampled_samples_[static_cast<size_t>(prompt)].at(static_cast<size_t>(res.sample.sample)) = std::move(s);
  }
}

std::vector<std::pair<std::string, double>> Evaluator::run(int64_t step, uint64_t version,
                                                           const std::function<void()>& pump) {
  const auto t0 = clock_.now();
  const int64_t n_prompts = data_->size(), k = cfg_.eval.n_samples;
  queue_.clear();
  for (int64_t i = 0; i < n_prompts; ++i) {
    if (cfg_.eval.greedy) queue_.emplace_back(i, true);
    if (k > 0) queue_.emplace_back(i, false);
  }
  next_ = 0;
  version_ = version;
  live_.clear();
  in_flight_.assign(engines_.size(), 0);
  greedy_samples_.assign(static_cast<size_t>(n_prompts), Sample{});
  sampled_samples_.assign(static_cast<size_t>(n_prompts), std::vector<Sample>(static_cast<size_t>(k)));
  keep_.assign(static_cast<size_t>(n_prompts), 0);
  std::map<std::string, int64_t> kept;
  for (int64_t i = 0; i < n_prompts; ++i) {
    int64_t& c = kept[source_of(i)];
    if (cfg_.eval.samples_per_source < 0 || c < cfg_.eval.samples_per_source) {
      keep_[static_cast<size_t>(i)] = 1;
      ++c;
    }
  }
  draining_.assign(engines_.size(), 0);
  progress_.assign(engines_.size(), clock_.now());
  last_progress_ = clock_.now();
  retired_seen_ = retired_count();
  returned_ = 0;
  expected_ = n_prompts * ((cfg_.eval.greedy ? 1 : 0) + k);
  if (rewards_.sources.batched) rewards_.sources.batched->begin_step(static_cast<uint64_t>(step));
  send_more();
  while (returned_ < expected_) {
    pump();
    check_progress(step);
    send_more();
  }
  if (rewards_.sources.batched) {
    for (const auto& [id, score] : rewards_.sources.batched->finish(Deadline::after_seconds(cfg_.timeouts.generate_s))) {
      const auto prompt = static_cast<size_t>(id / static_cast<uint64_t>(k + 1));
      const auto j = static_cast<int64_t>(id % static_cast<uint64_t>(k + 1)) - 1;
      (j < 0 ? greedy_samples_.at(prompt) : sampled_samples_.at(prompt).at(static_cast<size_t>(j))).reward = score;
    }
  }
  std::vector<std::pair<std::string, double>> out = metrics();
  write_samples(step);
  const double seconds = seconds_between(t0, clock_.now());
  out.emplace_back("time/eval", seconds);
  const auto value = [&](const std::string& key) {
    for (const auto& [k2, v] : out)
      if (k2 == key) return v;
    return 0.0;
  };
  log::info("eval after step {}: {}{} ({} prompts, {:.1f} s)", step,
            cfg_.eval.greedy ? fmt::format("greedy accuracy {:.3f}", value("eval/all/greedy_accuracy")) : std::string(),
            k > 0 ? fmt::format("{}pass@{} {:.3f}, mean@{} {:.3f}", cfg_.eval.greedy ? ", " : "", k,
                                value(fmt::format("eval/all/pass@{}", k)), k, value(fmt::format("eval/all/mean@{}", k)))
                  : std::string(),
            n_prompts, seconds);
  return out;
}

std::vector<std::pair<std::string, double>> Evaluator::metrics() const {
  struct Totals {
    double prompts = 0, greedy_correct = 0, greedy_reward = 0, passed = 0, correct = 0, reward = 0, samples = 0,
           tokens = 0, generated = 0;
  };
  std::map<std::string, Totals> by;
  const int64_t k = cfg_.eval.n_samples;
  const double bar = cfg_.eval.correct_reward;
  for (int64_t i = 0; i < data_->size(); ++i) {
    for (Totals* t : {&by[source_of(i)], &by["all"]}) {
      t->prompts += 1;
      if (cfg_.eval.greedy) {
        const Sample& g = greedy_samples_[static_cast<size_t>(i)];
        t->greedy_correct += g.reward >= bar ? 1 : 0;
        t->greedy_reward += g.reward;
        t->tokens += static_cast<double>(g.tokens);
        t->generated += 1;
      }
      bool any = false;
      for (const Sample& s : sampled_samples_[static_cast<size_t>(i)]) {
        any = any || s.reward >= bar;
        t->correct += s.reward >= bar ? 1 : 0;
        t->reward += s.reward;
        t->samples += 1;
        t->tokens += static_cast<double>(s.tokens);
        t->generated += 1;
      }
      if (k > 0) t->passed += any ? 1 : 0;
    }
  }
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [source, t] : by) {
    const std::string p = "eval/" + source + "/";
    out.emplace_back(p + "prompts", t.prompts);
    if (cfg_.eval.greedy) {
      out.emplace_back(p + "greedy_accuracy", t.greedy_correct / t.prompts);
      out.emplace_back(p + "greedy_reward", t.greedy_reward / t.prompts);
    }
    if (k > 0) {
      out.emplace_back(p + fmt::format("pass@{}", k), t.passed / t.prompts);
      out.emplace_back(p + fmt::format("mean@{}", k), t.correct / t.samples);
      out.emplace_back(p + "reward_mean", t.reward / t.samples);
    }
    out.emplace_back(p + "response_length", t.generated > 0 ? t.tokens / t.generated : 0.0);
  }
  return out;
}

void Evaluator::write_samples(int64_t step) const {
  const std::string dir = cfg_.run.output_dir + "/eval";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("{}: cannot create the folder of evaluation samples: {}", dir, ec.message()));
  std::string text;
  const auto line = [&](int64_t i, const Sample& s, const char* kind, int64_t j) {
    const data::Prompt& p = data_->at(i);
    nlohmann::ordered_json o;
    o["step"] = step;
    o["data_source"] = source_of(i);
    o["line"] = p.line;
    o["kind"] = kind;
    o["sample"] = j;
    o["prompt"] = p.text;
    o["response"] = decode_(s.ids);
    o["label"] = p.label;
    o["reward"] = s.reward;
    o["correct"] = s.reward >= cfg_.eval.correct_reward;
    o["tokens"] = s.tokens;
    o["finish_reason"] = s.finish_reason;
    text += o.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  };
  for (int64_t i = 0; i < data_->size(); ++i) {
    if (!keep_[static_cast<size_t>(i)]) continue;
    if (cfg_.eval.greedy) line(i, greedy_samples_[static_cast<size_t>(i)], "greedy", 0);
    const auto& ss = sampled_samples_[static_cast<size_t>(i)];
    for (size_t j = 0; j < ss.size(); ++j) line(i, ss[j], "sampled", static_cast<int64_t>(j));
  }
  write_file_atomic(fmt::format("{}/step_{}.jsonl", dir, step), text);
}

}  // namespace tiller::controller
