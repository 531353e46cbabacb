#include "testing/synthetic.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::testing {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int64_t token_at(uint64_t seed, int64_t pos, int64_t vocab) {
  return static_cast<int64_t>(mix(seed * 1315423911ull + static_cast<uint64_t>(pos)) % static_cast<uint64_t>(vocab));
}

at::Tensor float_per_token(const wire::PackedSequences& b, const std::function<float(int64_t)>& f) {
  TILLER_CHECK(b.whole(), "the synthetic trainer scores whole micro-batches (no sequence parallelism)");
  at::Tensor out = at::empty({b.response_tokens()}, at::kFloat);
  float* p = out.data_ptr<float>();
  const int64_t* t = b.tokens.data_ptr<int64_t>();
  const int64_t* sl = b.seq_lens.data_ptr<int64_t>();
  const int64_t* pl = b.prompt_lens.data_ptr<int64_t>();
  int64_t off = 0;
  for (int64_t i = 0; i < b.size(); ++i) {
    for (int64_t k = pl[i]; k < sl[i]; ++k) *p++ = f(t[off + k]);
    off += sl[i];
  }
  return out;
}

}  // namespace

float synthetic_logprob(int64_t t) { return -0.1f - static_cast<float>(t % 13) * 0.1f; }

// --- SyntheticEngines ---

SyntheticEngines::SyntheticEngines(const SyntheticEngineOptions& opts) : opts_(opts), engines_(opts.engines) {
  TILLER_CHECK(opts_.engines >= 1 && opts_.min_len >= 1 && opts_.max_len >= opts_.min_len && opts_.vocab >= 2 &&
                   opts_.max_running >= 1,
               "synthetic engines: bad options");
  TILLER_CHECK(opts_.dying_engine < 0 || (static_cast<size_t>(opts_.dying_engine) < opts_.engines && opts_.tokens_per_s <= 0),
               "synthetic engines: a dying engine needs virtual time and an index below the engine count");
}

bool SyntheticEngines::retire(size_t i, const std::string&) {
  std::lock_guard<std::mutex> lock(mu_);
  if (opts_.dying_engine < 0) return false;
  Engine& e = engines_.at(i);
  e.retired = true;
  e.running.clear();
  e.waiting.clear();
  return true;
}

bool SyntheticEngines::retired(size_t i) const {
  std::lock_guard<std::mutex> lock(mu_);
  return engines_.at(i).retired;
}

SyntheticEngines::~SyntheticEngines() { close(); }

std::string SyntheticEngines::name(size_t i) const { return fmt::format("synthetic engine {}", i); }

void SyntheticEngines::open() {
  if (opts_.tokens_per_s > 0 && !clock_.joinable()) clock_ = std::thread([this] { run_clock(); });
}

void SyntheticEngines::submit(size_t i, const engine::Request& r, uint64_t min_weight_version) {
  std::lock_guard<std::mutex> lock(mu_);
  TILLER_CHECK(min_weight_version <= version_, "synthetic engine {}: asked for version {}, it has {}", i,
               min_weight_version, version_);
  TILLER_CHECK(sleep_level_ == 0, "synthetic engine {}: a request while asleep (level {})", i, sleep_level_);
  TILLER_CHECK(!weights_lost_, "synthetic engine {}: a request after its weights were freed (sleep 2) with no sync since", i);
  Engine& e = engines_.at(i);
  TILLER_CHECK(!e.retired, "a request to synthetic engine {}, which left the job", i);
  if (e.dead) throw CommError(fmt::format("synthetic engine {}: Generate failed: Socket closed (14)", i));
  ++e.requests;
  for (int64_t j = 0; j < r.n; ++j) {
    Seq s;
    s.request = r.id;
    s.sample = j;
    s.seed = r.params.seed + static_cast<uint64_t>(j);
    const auto span = static_cast<uint64_t>(opts_.max_len - opts_.min_len + 1);
    s.length = std::min<int64_t>(opts_.min_len + static_cast<int64_t>(mix(s.seed) % span), r.params.max_new_tokens);
    e.waiting.push_back(std::move(s));
  }
  admit(e);
  cv_.notify_all();
}

void SyntheticEngines::admit(Engine& e) {
  while (!e.waiting.empty() && static_cast<int64_t>(e.running.size()) < opts_.max_running) {
    e.running.push_back(std::move(e.waiting.front()));
    e.waiting.pop_front();
  }
}

void SyntheticEngines::finish(Seq& s, const char* reason) {
  controller::Completion c;
  c.engine = -1;
  engine::SampleOutput& o = c.result.sample;
  o.request_id = s.request;
  o.sample = s.sample;
  o.finish_reason = reason;
  o.tokens.resize(static_cast<size_t>(s.done));
  o.logprobs.resize(static_cast<size_t>(s.done));
  for (int64_t k = 0; k < s.done; ++k) {
    o.tokens[static_cast<size_t>(k)] = token_at(s.seed, k, opts_.vocab);
    o.logprobs[static_cast<size_t>(k)] = synthetic_logprob(o.tokens[static_cast<size_t>(k)]);
  }
  if (std::string(reason) != "abort" && opts_.stop_on_even_last && s.done > 0 && o.tokens.back() % 2 == 0)
    o.finish_reason = "stop";
  o.version_starts = std::move(s.version_starts);
  o.versions = std::move(s.versions);
  c.result.weight_version = version_;
  done_.push_back(std::move(c));
}

void SyntheticEngines::advance(Engine& e, int64_t steps) {
  const size_t index = static_cast<size_t>(&e - engines_.data());
  for (Seq& s : e.running) {
    const int64_t take = std::min(steps, s.length - s.done);
    if (take <= 0) continue;
    if (s.versions.empty() || s.versions.back() != version_) {
      s.version_starts.push_back(s.done);
      s.versions.push_back(version_);
    }
    s.done += take;
    generated_tokens_ += take;
  }
  const size_t before = done_.size();
  for (auto it = e.running.begin(); it != e.running.end();) {
    if (it->done >= it->length) {
      finish(*it, "length");
      it = e.running.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t i = before; i < done_.size(); ++i) done_[i].engine = static_cast<int>(index);
  admit(e);
}

void SyntheticEngines::abort(size_t i, uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = engines_.at(i);
  const size_t before = done_.size();
  auto drop = [&](auto& seqs) {
    for (auto it = seqs.begin(); it != seqs.end();) {
      if (it->request != request_id) {
        ++it;
        continue;
      }
      finish(*it, "abort");
      it = seqs.erase(it);
    }
  };
  drop(e.running);
  drop(e.waiting);
  for (size_t k = before; k < done_.size(); ++k) done_[k].engine = static_cast<int>(i);
  admit(e);
  cv_.notify_all();
}

bool SyntheticEngines::next(controller::Completion& out, int wait_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (done_.empty() && wait_ms > 0 && opts_.tokens_per_s <= 0 && !paused_) {
    // Virtual time passes only while the caller waits: one decode step of every engine.
    for (size_t i = 0; i < engines_.size(); ++i) {
      Engine& e = engines_[i];
      if (static_cast<int>(i) == opts_.stalled_engine || e.dead || e.retired) continue;
      advance(e, 1);
      if (static_cast<int>(i) == opts_.dying_engine && ++e.steps >= opts_.die_after_steps) {
        // Its process ends: what it finished is out already, the rest is lost, its stream fails.
        e.dead = true;
        e.running.clear();
        e.waiting.clear();
        controller::Completion c;
        c.engine = static_cast<int>(i);
        c.failure = fmt::format("synthetic engine {}: Generate failed: Socket closed (14)", i);
        done_.push_back(std::move(c));
      }
    }
    if (opts_.clock) opts_.clock->advance(opts_.seconds_per_step);
  }
  TILLER_CHECK(opts_.stalled_engine < 0 || opts_.tokens_per_s <= 0, "a stalled synthetic engine needs virtual time");
  if (done_.empty() && wait_ms > 0 && opts_.tokens_per_s > 0)
    cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), [&] { return !done_.empty() || stopping_; });
  // A retired engine's completions (what it sent before it left, its stream's end) are moot, as
  // in EnginePool.
  while (!done_.empty() && engines_.at(static_cast<size_t>(done_.front().engine)).retired) done_.pop_front();
  if (done_.empty()) return false;
  out = std::move(done_.front());
  done_.pop_front();
  return true;
}

std::vector<engine::ServerMemory> SyntheticEngines::sleep(int level) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : engines_)
    TILLER_CHECK(e.running.empty() && e.waiting.empty(), "synthetic engines: sleep with samples in flight");
  sleep_level_ = std::max(sleep_level_, level);
  if (level >= 2) weights_lost_ = true;
  phases_.push_back(fmt::format("sleep {}", level));
  return std::vector<engine::ServerMemory>(engines_.size());
}

std::vector<engine::ServerMemory> SyntheticEngines::wake(bool weights, bool cache) {
  std::lock_guard<std::mutex> lock(mu_);
  if (weights || cache) sleep_level_ = std::min(sleep_level_, 1);
  if (cache) sleep_level_ = 0;
  phases_.push_back(cache ? "wake cache" : "wake weights");
  return std::vector<engine::ServerMemory>(engines_.size());
}

bool SyntheticEngines::generating() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : engines_)
    if (!e.running.empty() || !e.waiting.empty()) return true;
  return false;
}

std::vector<std::string> SyntheticEngines::phases() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phases_;
}

void SyntheticEngines::begin_update(uint64_t version, uint64_t) {
  std::lock_guard<std::mutex> lock(mu_);
  TILLER_CHECK(version > version_, "synthetic engines: update to {} from {}", version, version_);
  TILLER_CHECK(sleep_level_ < 2, "synthetic engines: a weight sync into weights asleep at level 2");
  phases_.push_back(fmt::format("sync {}", version));
  paused_ = true;
}

void SyntheticEngines::end_update(uint64_t version, double) {
  std::lock_guard<std::mutex> lock(mu_);
  version_ = version;
  weights_lost_ = false;
  paused_ = false;
  cv_.notify_all();
}

void SyntheticEngines::run_clock() {
  using Clock = std::chrono::steady_clock;
  auto last = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::microseconds(200));
    const auto now = Clock::now();
    const double dt = std::chrono::duration<double>(now - last).count();
    last = now;
    if (paused_) continue;
    const size_t before = done_.size();
    for (Engine& e : engines_) {
      if (e.running.empty()) {
        e.credit = 0;
        continue;
      }
      // The engine's tokens per second are shared by its running samples, one token each per step.
      e.credit += dt * opts_.tokens_per_s;
      const auto steps = static_cast<int64_t>(e.credit / static_cast<double>(e.running.size()));
      if (steps <= 0) continue;
      e.credit -= static_cast<double>(steps * static_cast<int64_t>(e.running.size()));
      advance(e, steps);
    }
    if (done_.size() != before) cv_.notify_all();
  }
}

std::vector<int64_t> SyntheticEngines::requests_received() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (const auto& e : engines_) out.push_back(e.requests);
  return out;
}

void SyntheticEngines::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (clock_.joinable()) clock_.join();
}

// --- SyntheticTrainer ---

std::vector<wire::Frame> SyntheticTrainer::handle(wire::Frame f) {
  std::vector<wire::Frame> out;
  switch (f.op) {
    case wire::Op::kScore: {
      const wire::ScoreRequest r = wire::ScoreRequest::decode(std::move(f));
      wire::ScoreReply a;
      a.roles = roles_;
      if (roles_.has(Role::kActor)) {
        a.actor_logp = float_per_token(r.batch, [](int64_t t) { return synthetic_logprob(t); });
        a.actor_entropy = at::ones({r.batch.response_tokens()}, at::kFloat);
      }
      if (roles_.has(Role::kCritic)) a.critic_values = at::full({r.batch.response_tokens()}, 0.5f, at::kFloat);
      if (roles_.has(Role::kRef))
        a.ref_logp = float_per_token(r.batch, [](int64_t t) { return synthetic_logprob(t) - 0.01f; });
      if (roles_.has(Role::kReward)) a.reward_scores = at::zeros({r.batch.ends()}, at::kFloat);
      scored_ += r.batch.response_tokens();
      if (watched_ && watched_->generating()) ++scored_while_generating_;
      out.push_back(a.encode());
      break;
    }
    case wire::Op::kTrainActor: {
      const wire::TrainActorRequest r = wire::TrainActorRequest::decode(std::move(f));
      pending_[role_index(Role::kActor)] += r.batch.response_tokens();
      break;
    }
    case wire::Op::kTrainCritic: {
      const wire::TrainCriticRequest r = wire::TrainCriticRequest::decode(std::move(f));
      pending_[role_index(Role::kCritic)] += r.batch.response_tokens();
      break;
    }
    case wire::Op::kStep: {
      const wire::StepRequest r = wire::StepRequest::decode(std::move(f));
      TILLER_CHECK(roles_.has(r.role), "synthetic trainer: a step of {} it does not hold", role_name(r.role));
      const auto i = static_cast<size_t>(role_index(r.role));
      wire::StepReply a;
      a.stats.tokens = static_cast<double>(pending_[i]);
      a.stats.loss = 0.5;
      a.stats.grad_norm = 1.0;
      tokens_[i] += pending_[i];
      pending_[i] = 0;
      ++steps_[i];
      out.push_back(a.encode());
      break;
    }
    case wire::Op::kSync:
      wire::SyncRequest::decode(std::move(f));
      ++syncs_;
      out.push_back(wire::SyncReply{0.001, 1e6}.encode());
      break;
    case wire::Op::kSave: wire::SaveRequest::decode(std::move(f)); out.push_back(wire::DoneReply{}.encode()); break;
    case wire::Op::kLoad: wire::LoadRequest::decode(std::move(f)); out.push_back(wire::DoneReply{}.encode()); break;
    case wire::Op::kTrace: wire::TraceRequest::decode(std::move(f)); out.push_back(wire::TraceReply{}.encode()); break;
    case wire::Op::kStop: wire::StopRequest::decode(std::move(f)); out.push_back(wire::StopReply{0}.encode()); break;
    case wire::Op::kPhase:
      phases_.push_back(wire::PhaseRequest::decode(std::move(f)).offload ? "offload" : "reload");
      out.push_back(wire::PhaseReply{}.encode());
      break;
    default: throw CommError(fmt::format("synthetic trainer: unexpected '{}'", wire::op_name(f.op)));
  }
  return out;
}

std::vector<wire::Frame> SyntheticEngineRank::handle(wire::Frame f) {
  wire::StopRequest::decode(std::move(f));
  return {wire::StopReply{0}.encode()};
}

// --- SyntheticPrompts ---

SyntheticPrompts::SyntheticPrompts(int64_t count, int64_t len, int64_t vocab) {
  TILLER_CHECK(count >= 1 && len >= 1 && vocab >= 2, "synthetic prompts: bad sizes");
  prompts_.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    data::Prompt& p = prompts_[static_cast<size_t>(i)];
    p.line = i + 1;
    // As a chat template would have wrapped it (the agent loop's harness gets `input`).
    p.input = fmt::format("prompt {}", i);
    p.text = fmt::format("user: {}\nassistant:", p.input);
    for (int64_t k = 0; k < len; ++k) p.tokens.push_back(token_at(static_cast<uint64_t>(i), k, vocab));
  }
}

int64_t SyntheticPrompts::next() { return cursor_++ % static_cast<int64_t>(prompts_.size()); }

}  // namespace tiller::testing
