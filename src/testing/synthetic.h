// Stand-ins for the engines and the trainer ranks, so that the controller's real parts (collector,
// packer, host arrays, protocol, advantages, training dispatch) run in one process without a
// model: the controller's unit tests and `tiller bench controller` (the tiller::testing library).
//
// SyntheticEngines models continuous batching: each engine runs up to max_running samples at a
// time, every decode step gives each running sample one token, and a sample's length is drawn
// from its seed (uniform in [min_len, max_len]). A weight update pauses the engines; a sample in
// flight across it continues with the new version (as rollout.partial does on real engines). Its
// tokens and log-probs are functions of (seed, position), so a test can check them.
//   virtual time (tokens_per_s = 0): time passes only while the controller waits for a completion
//     (next() with a wait): one decode step of every engine per wait, deterministically, on the
//     caller's thread;
//   real time (tokens_per_s > 0): a thread of its own advances each engine at that many tokens/s
//     (across its running samples) and queues completions.
//
// SyntheticTrainer answers every request of messages.h with numbers derived from the tokens: the
// actor's log-prob of token t is synthetic_logprob(t), the reference's 0.01 lower, values 0.5,
// reward-model scores the share of even ids; the steps count the tokens they were given.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "controller/collector.h"
#include "controller/engine_set.h"
#include "tiller/data/prompt_dataset.h"
#include "wire/channel.h"

namespace tiller::testing {

// The log-prob the synthetic engines and actor give token id t.
float synthetic_logprob(int64_t t);

struct SyntheticEngineOptions {
  size_t engines = 1;
  int64_t max_running = 256;  // samples an engine decodes at once
  int64_t min_len = 1, max_len = 16;
  int64_t vocab = 1000;
  double tokens_per_s = 0;    // per engine; 0: virtual time
  bool stop_on_even_last = false;  // finish_reason "stop" for samples whose last id is even
  // Virtual time: each decode step also moves this clock on (the controller's deadlines run on it).
  ManualClock* clock = nullptr;
  double seconds_per_step = 0;
  int stalled_engine = -1;  // this engine takes requests and never decodes (a hung engine)
  // Virtual time: this engine dies after its die_after_steps-th decode step, as a standalone engine
  // whose process ends: its stream fails (a Completion with the failure) and a request to it throws
  // CommError. The set is elastic then (retire() takes an engine out, as EnginePool's).
  int dying_engine = -1;
  int64_t die_after_steps = 0;
};

class SyntheticEngines final : public controller::EngineSet {
 public:
  explicit SyntheticEngines(const SyntheticEngineOptions& opts);
  ~SyntheticEngines() override;

  size_t size() const override { return opts_.engines; }
  std::string name(size_t i) const override;
  uint64_t install_sync_plan(const std::string&) override { return 0; }
  void open() override;
  void submit(size_t i, const engine::Request& r, uint64_t min_weight_version) override;
  void abort(size_t i, uint64_t request_id) override;
  bool next(controller::Completion& out, int wait_ms) override;
  void begin_update(uint64_t version, uint64_t plan_id) override;
  void end_update(uint64_t version, double timeout_s) override;
  bool retire(size_t i, const std::string& why) override;
  bool elastic() const override { return opts_.dying_engine >= 0; }
  bool retired(size_t i) const override;
  void release_session(size_t, engine::SessionKey) override {}  // keeps no KV cache to park
  std::vector<engine::EngineStats> stats() override { return {}; }
  // Sleep and wake keep the real engines' rules: sleep only when idle, no request while the cache
  // sleeps, no sync into weights asleep at level 2 (each a broken invariant here).
  std::vector<engine::ServerMemory> sleep(int level) override;
  std::vector<engine::ServerMemory> wake(bool weights, bool cache) override;
  void close() override;
  // Every sleep, wake and weight update in order: "sleep 2", "wake weights", "wake cache", "sync 3".
  std::vector<std::string> phases() const;
  // Whether any engine holds a sample it has not finished (any thread).
  bool generating() const;

  // Samples generated so far, over all engines; requests each engine received.
  int64_t generated_tokens() const { return generated_tokens_; }
  std::vector<int64_t> requests_received() const;

 private:
  struct Seq {
    uint64_t request = 0;
    int64_t sample = 0;
    uint64_t seed = 0;
    int64_t length = 0, done = 0;
    std::vector<int64_t> version_starts;
    std::vector<uint64_t> versions;
  };
  struct Engine {
    std::deque<Seq> waiting;
    std::vector<Seq> running;
    int64_t requests = 0;
    double credit = 0;  // real time: tokens it may still produce
    int64_t steps = 0;  // decode steps taken (virtual time)
    bool dead = false, retired = false;
  };
  // Under mu_: advances engine e by `steps` decode steps, queueing what finishes.
  void advance(Engine& e, int64_t steps);
  void admit(Engine& e);
  void finish(Seq& s, const char* reason);
  void run_clock();

  SyntheticEngineOptions opts_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Engine> engines_;
  std::deque<controller::Completion> done_;
  uint64_t version_ = 0;
  bool paused_ = false, stopping_ = false;
  int sleep_level_ = 0;  // 0 awake; 1 no cache; 2 no cache, no weights
  bool weights_lost_ = false;  // freed by a level-2 sleep and not refilled by a sync since
  std::vector<std::string> phases_;
  std::atomic<int64_t> generated_tokens_{0};
  std::thread clock_;
};

class SyntheticTrainer final : public wire::RankEndpoint {
 public:
  explicit SyntheticTrainer(RoleSet roles) : roles_(roles) {}
  std::vector<wire::Frame> handle(wire::Frame f) override;
  // What it was given: tokens per role, optimizer steps per role, syncs.
  int64_t trained_tokens(Role r) const { return tokens_[static_cast<size_t>(role_index(r))]; }
  int64_t steps(Role r) const { return steps_[static_cast<size_t>(role_index(r))]; }
  int64_t syncs() const { return syncs_; }
  // The hybrid phase requests in order: "offload", "reload".
  const std::vector<std::string>& phases() const { return phases_; }
  int64_t scored_tokens() const { return scored_; }
  // Counts the score requests that arrive while `engines` still generate (a hybrid job's trainers
  // and engines sharing GPUs); `engines` must outlive the trainer's requests.
  void watch(const SyntheticEngines* engines) { watched_ = engines; }
  int64_t scored_while_generating() const { return scored_while_generating_; }

 private:
  RoleSet roles_;
  std::array<int64_t, kRoleCount> tokens_{}, pending_{}, steps_{};
  int64_t syncs_ = 0, scored_ = 0;
  std::vector<std::string> phases_;
  const SyntheticEngines* watched_ = nullptr;
  int64_t scored_while_generating_ = 0;
};

// An engine leader's endpoint: it only answers StopRequest.
class SyntheticEngineRank final : public wire::RankEndpoint {
 public:
  std::vector<wire::Frame> handle(wire::Frame f) override;
};

// Prompts of `len` tokens (ids from the index), labels empty, an endless supply.
class SyntheticPrompts final : public controller::PromptSource {
 public:
  SyntheticPrompts(int64_t count, int64_t len, int64_t vocab);
  int64_t next() override;
  const data::Prompt& at(int64_t index) const override { return prompts_.at(static_cast<size_t>(index)); }
  data::DatasetCursor cursor() const override { return {0, cursor_}; }
  void seek(const data::DatasetCursor& c) override { cursor_ = c.position; }
  int64_t drawn() const { return cursor_; }

 private:
  std::vector<data::Prompt> prompts_;
  int64_t cursor_ = 0;
};

}  // namespace tiller::testing
