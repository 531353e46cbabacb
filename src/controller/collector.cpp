#include "controller/collector.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/reward/batched_reward.h"

namespace tiller::controller {
namespace {

constexpr int kUnavailable = 14;  // grpc::StatusCode::UNAVAILABLE: the engine drains

// Samples queued on one engine, in units of engines.max_num_seqs, beyond which dispatch waits:
// enough that an engine never idles between two of the controller's rounds.
constexpr int64_t kQueuedPerSeqSlot = 2;
// Completions taken per pump before the rest of the work gets a turn.
constexpr int kMaxCompletionsPerPump = 4096;

}  // namespace

CollectorConfig CollectorConfig::from_job(const JobConfig& job, const std::vector<int64_t>& stop_ids, bool have_ref,
                                          bool have_critic) {
  CollectorConfig c;
  const RolloutConfig& r = job.rollout;
  c.batch_size = r.batch_size;
  c.n = r.n_samples_per_prompt;
  c.staleness = r.staleness();
  c.stale_policy = r.stale_policy;
  c.filter_groups = r.filter_groups;
  c.filter_max_extra = r.filter_max_extra_batches * r.batch_size;
  c.critic_warmup_steps = job.train.critic_warmup_steps;
  c.num_steps = job.train.num_steps;
  c.max_in_flight_per_engine = job.engines.max_num_seqs * kQueuedPerSeqSlot;
  c.min_engines = job.engines.standalone() ? job.engines.min_count : 1;
  c.progress_timeout_s = job.timeouts.generate_s;
  c.score_timeout_s = job.timeouts.train_s;
  c.score_micro_batch_tokens = r.micro_batch_tokens;
  c.score_temperature = r.temperature > 0 ? r.temperature : 1.0;
  c.score_actor = job.train.old_logprobs != OldLogprobs::kForward;
  c.sampling.greedy = r.temperature == 0;
  c.sampling.temperature = r.temperature > 0 ? r.temperature : 1.0;
  c.sampling.top_p = r.top_p > 0 ? r.top_p : 1.0;
  c.sampling.top_k = r.top_k > 0 ? r.top_k : 0;
  c.sampling.max_new_tokens = r.max_new_tokens;
  c.sampling.stop_token_ids = stop_ids;
  c.seed = static_cast<uint64_t>(job.run.seed);
  c.layout.ref = have_ref;
  c.layout.critic = have_critic;
  c.loop = job_sample_loop(job);
  c.job = &job;
  c.layout.turns = find_sample_loop(c.loop).turns;
  c.env_threads = static_cast<int>(job.env.concurrency);
  c.env_timeout_s = job.env.timeout_s;
  c.max_turns = job.rollout.max_turns;
  c.max_response_tokens = job.response_limit();
  c.max_prompt_tokens = job.rollout.max_prompt_tokens;
  return c;
}

RolloutCollector::RolloutCollector(const CollectorConfig& cfg, EngineSet& engines, wire::TrainerLink& link,
                                   PromptSource& prompts, RewardSources rewards, const std::vector<wire::TrainerGroup>& groups,
                                   LoopSources loop_sources)
    : cfg_(cfg), engines_(engines), link_(link), prompts_(prompts), rewards_(std::move(rewards)),
      groups_(wire::scoring_groups(groups, cfg.score_actor)) {
  TILLER_CHECK(cfg_.batch_size >= 1 && cfg_.n >= 1 && cfg_.staleness >= 0, "collector: bad sizes");
  TILLER_CHECK(engines_.size() > 0, "collector: no engine");
  const SampleLoopDef& def = find_sample_loop(cfg_.loop);
  loop_turns_ = def.turns;
  TILLER_CHECK(cfg_.layout.turns == loop_turns_, "collector: layout.turns {} for the sample loop '{}' (turns {})",
               cfg_.layout.turns, cfg_.loop, loop_turns_);
  if (def.needs_environment && !loop_sources.environment)
    throw ConfigError(fmt::format("rollout.loop = {}: this loop needs an environment (env.type)", cfg_.loop));
  SampleLoopContext ctx;
  ctx.job = cfg_.job;
  ctx.host = this;
  ctx.n = cfg_.n;
  ctx.sampling = cfg_.sampling;
  ctx.max_turns = cfg_.max_turns;
  ctx.max_response_tokens = cfg_.max_response_tokens;
  ctx.max_prompt_tokens = cfg_.max_prompt_tokens;
  ctx.environment = std::move(loop_sources.environment);
  ctx.env_threads = cfg_.env_threads;
  ctx.env_timeout_s = cfg_.env_timeout_s;
  ctx.session_prefix = std::move(loop_sources.session_prefix);
  ctx.observation_tokens = std::move(loop_sources.observation_tokens);
  ctx.decode = std::move(loop_sources.decode);
  ctx.tokenizer = std::move(loop_sources.tokenizer);
  ctx.chat = std::move(loop_sources.chat);
  loop_ = def.make(ctx);
  if (!loop_) throw ConfigError(fmt::format("sample loop '{}': its factory returned no loop", cfg_.loop));
}

RolloutCollector::~RolloutCollector() = default;

void RolloutCollector::start(int64_t first_step, uint64_t version, const std::vector<PendingPrompt>& resend,
                             int64_t next_ordinal) {
  version_ = version;
  next_ordinal_ = next_ordinal;
  resend_ = resend;
  std::sort(resend_.begin(), resend_.end(),
            [](const PendingPrompt& a, const PendingPrompt& b) { return a.ordinal > b.ordinal; });  // back = oldest
  in_flight_.assign(engines_.size(), 0);
  load_.assign(engines_.size(), 0);
  last_progress_.assign(engines_.size(), cfg_.clock->now());
  moved_off_.assign(engines_.size(), 0);
  draining_.assign(engines_.size(), 0);
  engines_.open();
  open_ = true;
  begin_forming(first_step, version, RoleSet{});
}

void RolloutCollector::begin_forming(int64_t step, uint64_t train_version, RoleSet held) {
  batch_ = std::make_unique<StepBatch>(cfg_.layout);
  if (!spare_.empty()) {
    batch_->ro = std::move(spare_.back());
    spare_.pop_back();
  }
  batch_->step = step;
  batch_->train_version = train_version;
  batch_->formed_since = cfg_.clock->now();
  batch_->first_dispatch = SteadyClock::time_point::max();
  held_ = held;
  scoring_.clear();
  scoring_open_.clear();
  packed_.assign(groups_.size(), 0);
  for (const auto& g : groups_) {
    scoring_.push_back(
        std::make_unique<ScoreRounds>(g, cfg_.score_micro_batch_tokens, cfg_.score_temperature, cfg_.score_timeout_s));
    bool open = true;
    for (Role r : kRoles)
      if (g.has(r) && held.has(r)) open = false;
    scoring_open_.push_back(open);
  }
}

int64_t RolloutCollector::forming_step() const { return batch_ ? batch_->step : 0; }

int64_t RolloutCollector::capacity() const {
  // Steps from the forming one that train within k versions of the engines' weights, counting
  // one update per step past the critic warmup (a step that skips its update only lags less); at
  // most k + 1 of them (during the warmup every version is the same, and memory still counts).
  const uint64_t limit = version_ + static_cast<uint64_t>(cfg_.staleness);
  uint64_t v = batch_->train_version;
  int64_t steps = 0;
  for (int64_t j = batch_->step; j <= cfg_.num_steps && steps <= cfg_.staleness && v <= limit; ++j) {
    ++steps;
    if (j > cfg_.critic_warmup_steps) ++v;
  }
  return steps * cfg_.batch_size;
}

uint64_t RolloutCollector::group_seed(int64_t ordinal) const {
  // The seed of the on-policy loop: step (ordinal / batch_size), slot (ordinal % batch_size).
  const auto quota = static_cast<uint64_t>(ordinal / cfg_.batch_size), slot = static_cast<uint64_t>(ordinal % cfg_.batch_size);
  return cfg_.seed * 1000003ull + quota * 65537ull + slot * static_cast<uint64_t>(cfg_.n);
}

void RolloutCollector::send(int64_t ordinal, int64_t dataset_index) {
  const size_t e = least_loaded();
  Group g;
  g.ordinal = ordinal;
  g.dataset_index = dataset_index;
  g.engine = static_cast<int>(e);
  g.dispatch_version = version_;
  g.dispatched = cfg_.clock->now();
  load_[e] += cfg_.n;
  g.finished.assign(static_cast<size_t>(cfg_.n), 0);
  outstanding_.emplace(ordinal, std::move(g));
  loop_->start(ordinal);
}

void RolloutCollector::dispatch() {
  if (paused_) return;
  const int64_t cap = capacity();
  while (static_cast<int64_t>(outstanding_.size()) < cap) {
    if (load_[least_loaded()] >= cfg_.max_in_flight_per_engine) return;
    if (!resend_.empty()) {
      const PendingPrompt p = resend_.back();
      resend_.pop_back();
      send(p.ordinal, p.dataset_index);
    } else {
      send(next_ordinal_++, prompts_.next());
    }
  }
}

void RolloutCollector::take(Completion& c) {
  const auto e = static_cast<size_t>(c.engine);
  if (!c.failure.empty()) return engine_failed(e, c.failure);
  if (c.result.error_code == kUnavailable && c.result.sample.request_id == engine::kDrainNotice)
    return engine_draining(e);
  TILLER_CHECK(e < in_flight_.size(), "a completion from engine {} of {}", e, in_flight_.size());
  if (c.result.sample.request_id >= side_base_ && side_sink_) {
    last_progress_[e] = cfg_.clock->now();  // the engine is working
    side_sink_(c);
    return;
  }
  const engine::ClientResult& res = c.result;
  auto req = live_.find(res.sample.request_id);
  if (res.error_code == kUnavailable && req != live_.end()) {  // sent before its drain's notice came
    engine_draining(e);
    resend(res.sample.request_id);
    return;
  }
  TILLER_CHECK(req != live_.end(), "{} answered request {}, which no sample loop sent", engines_.name(e),
               res.sample.request_id);
  // A request sent again after its engine left: the samples that came back before are repeats,
  // and it stays in live_ until the last of them is back too (they come in any order).
  Live& live = req->second;
  const auto index = static_cast<size_t>(res.sample.sample);
  if (res.error_code == 0 && index < live.back.size()) {
    if (live.back[index]) {
      if (--live.repeats <= 0 && live.remaining <= 0) live_.erase(req);
      return;
    }
    live.back[index] = 1;
  }
  const int64_t group = live.group;
  const bool keep_session = live.keep_session, aborted = live.aborted;
  if (--live.remaining <= 0 && live.repeats <= 0) live_.erase(req);
  auto it = outstanding_.find(group);
  if (res.error_code != 0) {
    const std::string where = it == outstanding_.end()
                                  ? std::string("a request")
                                  : fmt::format("prompt line {}", prompts_.at(it->second.dataset_index).line);
    throw Error(fmt::format("{} refused {}: {}", engines_.name(e), where, res.error));
  }
  in_flight_[e] -= 1;
  last_progress_[e] = cfg_.clock->now();
  if (draining_[e] && in_flight_[e] == 0 && engines_.retire(e, "drained: every request it held finished"))
    moved_off_[e] = 1;
  const bool aborted_by_engine = res.sample.finish_reason == "abort";
  if (it == outstanding_.end() || aborted) {
    // A sample of a group dropped (or a request aborted) while it was generating; one that
    // finished before its abort arrived left its cache parked.
    if (keep_session && !aborted_by_engine) engines_.release_session(e, {res.sample.request_id, res.sample.sample});
    return;
  }
  if (aborted_by_engine)
    throw Error(fmt::format("{} aborted sample {} of prompt line {} that the controller did not drop", engines_.name(e),
                            res.sample.sample, prompts_.at(it->second.dataset_index).line));
  loop_->generated(group, res.sample.request_id, std::move(c.result.sample));
}

void RolloutCollector::arrive(Group& g, Staged st) {
  const engine::SampleOutput& s = st.out;
  ++g.arrived;
  load_[static_cast<size_t>(g.engine)] -= 1;
  for (uint64_t v : s.versions) g.oldest = std::min(g.oldest, v);
  if (s.versions.empty()) g.oldest = std::min(g.oldest, version_);
  const data::Prompt& p = prompts_.at(g.dataset_index);
  if (rewards_.rule) st.score = static_cast<float>(rewards_.rule(p, s));
  if (rewards_.batched) {
    reward::RewardSample rs;
    st.uid = next_uid_++;
    rs.id = st.uid;
    rs.prompt = p.text;
    rs.response = rewards_.decode(s.tokens);
    rs.label = p.label;
    rs.label_is_json = p.label_is_json;
    rs.data_source = p.data_source;
    rs.extra_info = p.extra_info;
    rs.finish_reason = s.finish_reason;
    rs.prompt_index = static_cast<uint64_t>(p.line);
    rs.sample_index = static_cast<uint32_t>(s.sample);
    rs.response_tokens = static_cast<int64_t>(s.tokens.size());
    rewards_.batched->add(std::move(rs));
    async_unflushed_ = true;
    ++g.async_pending;
    async_slots_[st.uid] = {g.ordinal, static_cast<int64_t>(g.staged.size()), -1};
  }
  if (g.joined) {
    add_to_batch(g, std::move(st));
  } else {
    g.staged.push_back(std::move(st));
  }
}

std::string RolloutCollector::sample_where(int64_t ordinal, int64_t sample) const {
  auto it = outstanding_.find(ordinal);
  if (it == outstanding_.end()) return fmt::format("sample {} of prompt {}", sample, ordinal);
  return fmt::format("prompt line {}, sample {}", prompts_.at(it->second.dataset_index).line, sample);
}

void RolloutCollector::add_to_batch(Group& g, Staged st) {
  StepBatch& b = *batch_;
  const engine::SampleOutput& s = st.out;
  const int64_t id = b.ro.add(g.batch_index, s.sample, st.prompt.empty() ? prompts_.at(g.dataset_index).tokens : st.prompt,
                              s.tokens, s.logprobs, s.finish_reason == "length", s.version_starts, s.versions, version_,
                              loop_turns_ ? &st.turns : nullptr);
  b.ro.score[static_cast<size_t>(id)] = st.score;
  if (s.route_width > 0) b.ro.set_routes(s.routes, s.route_width);  // routing replay
  if (!cfg_.score_actor)  // nobody scores the actor: its log-probs are the engine's
    std::copy(s.logprobs.begin(), s.logprobs.end(), b.ro.logp.end() - static_cast<std::ptrdiff_t>(s.logprobs.size()));
  b.generated_tokens += loop_turns_ ? b.ro.model_tokens(id) : static_cast<int64_t>(s.tokens.size());
  b.last_sample = cfg_.clock->now();
  if (rewards_.batched) {
    auto slot = async_slots_.find(st.uid);
    if (slot != async_slots_.end()) slot->second = {g.ordinal, -1, id};
  }
}

void RolloutCollector::join(Group& g) {
  StepBatch& b = *batch_;
  g.joined = true;
  g.batch_index = static_cast<int64_t>(b.groups.size());
  b.groups.push_back({g.ordinal, g.dataset_index, g.dispatch_version});
  b.first_dispatch = std::min(b.first_dispatch, g.dispatched);
  std::vector<Staged> staged = std::move(g.staged);
  g.staged.clear();
  for (auto& st : staged) add_to_batch(g, std::move(st));
  if (static_cast<int64_t>(b.groups.size()) == cfg_.batch_size) b.closed = true;
}

void RolloutCollector::drop(Group& g, const char* why) {
  StepBatch& b = *batch_;
  loop_->drop(g.ordinal);
  load_[static_cast<size_t>(g.engine)] -= cfg_.n - g.arrived;
  for (const auto& st : g.staged) async_slots_.erase(st.uid);
  if (std::string(why) == "filtered") {
    ++b.filtered_groups;
  } else {
    ++b.stale_dropped_groups;
    b.stale_dropped_samples += cfg_.n;
  }
  b.dropped.push_back({g.ordinal, g.dataset_index, g.dispatch_version, g.oldest, std::string(why)});
}

uint64_t RolloutCollector::lag_bound(const Group& g) const {
  // The oldest token of a group still generating is at best from the version it was sent at.
  const uint64_t oldest = g.arrived == cfg_.n ? g.oldest : std::min(g.oldest, g.dispatch_version);
  const uint64_t v = batch_->train_version;
  return v > oldest ? v - oldest : 0;
}

void RolloutCollector::join_ready() {
  StepBatch& b = *batch_;
  const auto k = static_cast<uint64_t>(cfg_.staleness);
  const bool wait = cfg_.stale_policy == StalePolicy::kWait;
  for (auto it = outstanding_.begin(); it != outstanding_.end() && !b.closed;) {
    Group& g = it->second;
    if (g.joined) {
      ++it;
      continue;
    }
    // Too stale for the forming step: it can only get staler. (Under wait only a step closed
    // early by the filter cap can push a group this far.)
    if (lag_bound(g) > k) {
      drop(g, "stale");
      it = outstanding_.erase(it);
      continue;
    }
    const bool done = complete(g);
    if (cfg_.filter_groups) {
      if (!done) {
        if (wait) break;  // in dispatch order
        ++it;
        continue;
      }
      const auto total = [](const Staged& s) { return s.score + s.turn_rewards; };
      const bool uniform = std::all_of(g.staged.begin(), g.staged.end(),
                                       [&](const Staged& s) { return total(s) == total(g.staged.front()); });
      if (uniform) {
        if (b.filtered_groups >= cfg_.filter_max_extra) {
          b.filter_cap_reached = true;
          b.closed = true;
          log::warn("step {}: rollout.filter_groups dropped {} groups whose rewards were all equal, the cap of "
                    "filter_max_extra_batches x batch_size; it trains the {} informative groups it has",
                    b.step, b.filtered_groups, b.groups.size());
          break;
        }
        drop(g, "filtered");
        it = outstanding_.erase(it);
        continue;
      }
    } else if (!wait && !done) {
      ++it;  // drop policy: complete groups only
      continue;
    }
    join(g);
    ++it;
  }
}

void RolloutCollector::take_async_scores() {
  if (!rewards_.batched) return;
  for (const auto& [uid, score] : rewards_.batched->poll()) {
    auto slot = async_slots_.find(uid);
    if (slot == async_slots_.end()) continue;  // its group was dropped
    auto g = outstanding_.find(slot->second.group);
    if (g != outstanding_.end()) --g->second.async_pending;
    if (slot->second.sample >= 0) {
      batch_->ro.score[static_cast<size_t>(slot->second.sample)] = static_cast<float>(score);
    } else if (g != outstanding_.end()) {
      g->second.staged.at(static_cast<size_t>(slot->second.staged)).score = static_cast<float>(score);
    }
    async_slots_.erase(slot);
  }
}

void RolloutCollector::post_scoring() {
  if (scoring_held_) return;
  StepBatch& b = *batch_;
  const int64_t total = b.ro.size();
  // Every sample of the step is in: the packers may release what they hold.
  const bool all_in = b.closed && total == static_cast<int64_t>(b.groups.size()) * cfg_.n;
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (!scoring_open_[i]) continue;
    for (; packed_[i] < total; ++packed_[i]) scoring_[i]->add(packed_[i], b.ro.seq_len(packed_[i]));
    scoring_[i]->post(link_, b.ro, b.scores, all_in);
  }
}

void RolloutCollector::check_progress() {
  const auto now = cfg_.clock->now();
  std::string stalled;
  for (size_t e = 0; e < in_flight_.size(); ++e) {
    if (in_flight_[e] == 0 || seconds_between(last_progress_[e], now) < cfg_.progress_timeout_s) continue;
    int64_t prompts = 0;
    for (const auto& [o, g] : outstanding_)
      if (g.engine == static_cast<int>(e) && g.arrived < cfg_.n) ++prompts;
    stalled += fmt::format("{}{} has {} samples of {} prompts in flight and returned none for {:.0f} s",
                           stalled.empty() ? "" : "; ", engines_.name(e), in_flight_[e], prompts,
                           seconds_between(last_progress_[e], now));
  }
  if (stalled.empty()) return;
  const std::string why = fmt::format("generation stalled (timeouts.generate_s = {} s): {}", cfg_.progress_timeout_s,
                                      stalled);
  std::vector<size_t> late;
  for (size_t e = 0; e < in_flight_.size(); ++e)
    if (in_flight_[e] > 0 && seconds_between(last_progress_[e], now) >= cfg_.progress_timeout_s) late.push_back(e);
  for (size_t e : late)
    if (!engines_.retire(e, why)) throw TimeoutError(why);
  for (size_t e : late) move_off(e);
}

bool RolloutCollector::pump(int wait_ms) {
  TILLER_CHECK(open_, "RolloutCollector::pump before start() or after close()");
  bool any = false;
  const size_t before = outstanding_.size() + static_cast<size_t>(next_ordinal_);
  // An engine retired by someone else (the evaluation found it dead or stalled): its work moves.
  for (size_t e = 0; e < moved_off_.size(); ++e)
    if (!moved_off_[e] && engines_.retired(e)) move_off(e);
  if (rewards_.batched) {
    const size_t slots = async_slots_.size();
    take_async_scores();
    any = any || async_slots_.size() != slots;
  }
  any = loop_->poll() || any;
  Completion c;
  int taken = 0;
  while (taken < kMaxCompletionsPerPump && engines_.next(c, 0)) {
    take(c);
    ++taken;
  }
  if (taken == 0 && !any && wait_ms > 0 && engines_.next(c, wait_ms)) {
    take(c);
    ++taken;
  }
  any = any || taken > 0;
  join_ready();
  dispatch();
  post_scoring();
  any = any || outstanding_.size() + static_cast<size_t>(next_ordinal_) != before;
  if (!any && async_unflushed_) {
    rewards_.batched->flush();
    async_unflushed_ = false;
  }
  check_progress();
  return any;
}

bool RolloutCollector::generation_done() const {
  const StepBatch& b = *batch_;
  if (!b.closed || b.ro.size() != static_cast<int64_t>(b.groups.size()) * cfg_.n) return false;
  for (const auto& g : b.groups) {
    auto it = outstanding_.find(g.ordinal);
    if (it != outstanding_.end() && it->second.async_pending > 0) return false;
  }
  return true;
}

bool RolloutCollector::batch_ready() const {
  if (!generation_done()) return false;
  const StepBatch& b = *batch_;
  for (size_t i = 0; i < scoring_.size(); ++i)
    if (!scoring_open_[i] || packed_[i] < b.ro.size() || !scoring_[i]->done()) return false;
  return true;
}

StepBatch& RolloutCollector::ready_batch() {
  TILLER_CHECK(batch_ready(), "ready_batch() before the step is ready");
  return *batch_;
}

void RolloutCollector::drop_ready_groups(const std::vector<uint8_t>& keep) {
  StepBatch& b = ready_batch();
  TILLER_CHECK(keep.size() == b.groups.size(), "{} keep flags for {} prompt groups", keep.size(), b.groups.size());
  if (std::all_of(keep.begin(), keep.end(), [](uint8_t k) { return k != 0; })) return;
  std::vector<int64_t> index(b.groups.size(), -1);  // old group -> new
  std::vector<uint64_t> oldest(b.groups.size(), UINT64_MAX);
  for (int64_t s = 0; s < b.ro.size(); ++s) {
    auto& o = oldest[static_cast<size_t>(b.ro.prompt[s])];
    o = std::min(o, b.ro.oldest_version(s));
  }
  std::vector<StepBatch::Group> kept;
  for (size_t g = 0; g < b.groups.size(); ++g) {
    const StepBatch::Group& grp = b.groups[g];
    if (keep[g]) {
      index[g] = static_cast<int64_t>(kept.size());
      kept.push_back(grp);
      continue;
    }
    ++b.filtered_groups;
    b.dropped.push_back({grp.ordinal, grp.dataset_index, grp.dispatch_version, oldest[g], "filtered"});
    outstanding_.erase(grp.ordinal);
  }
  Rollout ro(b.ro.layout);
  for (int64_t s = 0; s < b.ro.size(); ++s)
    if (const int64_t g = index[static_cast<size_t>(b.ro.prompt[s])]; g >= 0) ro.add_from(b.ro, s, g);
  b.ro = std::move(ro);
  b.groups = std::move(kept);
}

std::unique_ptr<StepBatch> RolloutCollector::take_batch(RoleSet will_train) {
  TILLER_CHECK(batch_ready(), "take_batch() before the step is ready");
  std::unique_ptr<StepBatch> out = std::move(batch_);
  out->ready_at = cfg_.clock->now();
  const uint64_t v = out->train_version;
  for (int64_t s = 0; s < out->ro.size(); ++s) {
    const uint64_t oldest = out->ro.oldest_version(s);
    TILLER_CHECK(v < oldest || v - oldest <= static_cast<uint64_t>(cfg_.staleness),
                 "step {}: sample {} of prompt group {} lags {} versions (max_staleness {})", out->step, s,
                 out->ro.prompt[s], v - oldest, cfg_.staleness);
  }
  for (const auto& g : out->groups) outstanding_.erase(g.ordinal);
  begin_forming(out->step + 1, v + (will_train.has(Role::kActor) ? 1 : 0), will_train);
  return out;
}

void RolloutCollector::recycle(std::unique_ptr<StepBatch> done) {
  if (!done || spare_.size() >= 2) return;
  done->ro.clear();
  spare_.push_back(std::move(done->ro));
}

void RolloutCollector::release(Role role) {
  RoleSet still;
  for (Role r : kRoles)
    if (held_.has(r) && r != role) still.add(r);
  held_ = still;
  for (size_t i = 0; i < groups_.size(); ++i) {
    bool open = true;
    for (Role r : kRoles)
      if (groups_[i].has(r) && held_.has(r)) open = false;
    scoring_open_[i] = open;
  }
}

void RolloutCollector::set_version(uint64_t version) {
  version_ = version;
  // The engines were paused for the sync: that was no stall of theirs.
  last_progress_.assign(engines_.size(), cfg_.clock->now());
}

int64_t RolloutCollector::in_flight_samples() const {
  // Samples the engines owe (aborted ones too, until they come back), and multi-turn samples
  // whose environment is answering (a sync or a hybrid phase change waits for their next turn).
  int64_t n = 0;
  for (int64_t v : in_flight_) n += v;
  return n + loop_->waiting();
}

std::vector<PendingPrompt> RolloutCollector::outstanding() const {
  std::vector<PendingPrompt> out(resend_.rbegin(), resend_.rend());
  for (const auto& [o, g] : outstanding_) out.push_back({g.ordinal, g.dataset_index});
  std::sort(out.begin(), out.end(), [](const PendingPrompt& a, const PendingPrompt& b) { return a.ordinal < b.ordinal; });
  return out;
}

void RolloutCollector::close() {
  if (!open_) return;
  open_ = false;
  for (const auto& [o, g] : outstanding_) loop_->drop(o);
  engines_.close();
}

}  // namespace tiller::controller
