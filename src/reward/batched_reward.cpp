// The batching half of every asynchronous reward: a queue of batches, worker threads that each
// score one batch at a time, and results gathered per step (an epoch number drops the results of
// a step that was abandoned). The state is shared with the workers, so that a worker stuck in a
// call can be left behind at shutdown without touching freed memory.
#include "tiller/reward/batched_reward.h"

#include <chrono>
#include <cmath>
#include <exception>
#include <mutex>

#include <fmt/format.h>

#include "core/worker_pool.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::reward {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxBatchSize = 4096;
constexpr int kMaxConcurrency = 4096;
// How long the destructor waits for workers inside a call before leaving them behind.
constexpr double kShutdownGraceSeconds = 5;

struct Batch {
  uint64_t epoch = 0, step = 0;
  std::vector<RewardSample> samples;
};

}  // namespace

void BatchScorer::cancel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) return;
    cancelled_ = true;
  }
  cv_.notify_all();
  on_cancel();
}

bool BatchScorer::cancelled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_;
}

bool BatchScorer::backoff(double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  return !cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return cancelled_; });
}

struct BatchedReward::State {
  std::shared_ptr<BatchScorer> scorer;
  int batch_size = 1;

  std::mutex mu;
  std::condition_variable cv;          // results
  std::unique_ptr<WorkerPool> pool;     // a batch per task
  Batch pending;                        // the batch being filled
  uint64_t epoch = 0, step = 0;
  int64_t outstanding = 0;              // samples of this epoch sent (or queued) and not yet scored
  std::vector<std::pair<uint64_t, double>> results;
  std::exception_ptr failure;           // the first failure of this epoch
  RewardStats stats;

  // A wrong count or a score that is not finite, as one line naming the sample.
  void check(const Batch& b, const BatchScores& r) const {
    if (r.scores.size() != b.samples.size())
      throw CommError(fmt::format("{}: answered {} scores for {} samples of step {}", scorer->where(),
                                  r.scores.size(), b.samples.size(), b.step));
    for (size_t i = 0; i < r.scores.size(); ++i) {
      if (!std::isfinite(r.scores[i]))
        throw CommError(fmt::format("{}: answered {} for sample {} of prompt line {} (step {}); scores must be finite",
                                    scorer->where(), r.scores[i], b.samples[i].sample_index,
                                    b.samples[i].prompt_index, b.step));
    }
  }

  // Scores one batch on a worker (the pool's task), and files its results under its epoch.
  void score(const Batch& b) {
    BatchScores r;
    std::exception_ptr error;
    const auto t0 = Clock::now();
    try {
      r = scorer->score(b.step, b.samples);
      check(b, r);
    } catch (...) {
      error = std::current_exception();
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    std::lock_guard<std::mutex> lock(mu);
    if (b.epoch != epoch) return;  // a step that was abandoned
    stats.retries += r.retries;
    if (!error) {
      ++stats.calls;
      stats.call_seconds += took;
      for (const auto& [name, v] : r.extras) {
        auto& s = stats.extras[name];
        s.first += v.first;
        s.second += v.second;
      }
      for (size_t i = 0; i < r.scores.size(); ++i) results.emplace_back(b.samples[i].id, r.scores[i]);
    } else if (!failure) {
      failure = error;
    }
    outstanding -= static_cast<int64_t>(b.samples.size());
    cv.notify_all();
  }

  // Under mu. The task holds the state weakly: a call left behind at shutdown touches no freed memory.
  static void enqueue_pending(const std::shared_ptr<State>& s) {
    if (s->pending.samples.empty()) return;
    s->pending.epoch = s->epoch;
    s->pending.step = s->step;
    s->pool->submit([w = std::weak_ptr<State>(s), b = std::move(s->pending)] {
      if (std::shared_ptr<State> st = w.lock()) st->score(b);
    });
    s->pending = Batch{};
  }

  void rethrow_failure() {  // under mu
    if (failure) std::rethrow_exception(failure);
  }
};

BatchedReward::BatchedReward(std::shared_ptr<BatchScorer> scorer, int batch_size, int concurrency)
    : scorer_(std::move(scorer)), state_(std::make_shared<State>()) {
  TILLER_CHECK(scorer_ != nullptr, "BatchedReward needs a scorer");
  if (batch_size < 1 || batch_size > kMaxBatchSize || concurrency < 1 || concurrency > kMaxConcurrency)
    throw ConfigError(fmt::format("{}: batch size {} and concurrency {} must be in [1, {}]", scorer_->where(),
                                  batch_size, concurrency, kMaxBatchSize));
  state_->scorer = scorer_;
  state_->batch_size = batch_size;
  state_->pool = std::make_unique<WorkerPool>(concurrency, scorer_->where(), "the reward's concurrency");
}

BatchedReward::~BatchedReward() {
  state_->pool->drop_queued();
  scorer_->cancel();
  state_->pool->shutdown(kShutdownGraceSeconds);
}

void BatchedReward::begin_step(uint64_t step) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.epoch;
  s.step = step;
  s.pool->drop_queued();
  s.pending = Batch{};
  s.outstanding = 0;
  s.results.clear();
  s.failure = nullptr;
}

void BatchedReward::add(RewardSample sample) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  s.rethrow_failure();
  s.pending.samples.push_back(std::move(sample));
  ++s.outstanding;
  if (static_cast<int>(s.pending.samples.size()) >= s.batch_size) State::enqueue_pending(state_);
}

std::vector<std::pair<uint64_t, double>> BatchedReward::finish(Deadline deadline) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  State::enqueue_pending(state_);
  const auto settled = [&] { return s.outstanding == 0 || s.failure; };
  bool done = true;
  if (deadline.is_never()) s.cv.wait(lock, settled);
  else done = s.cv.wait_until(lock, deadline.at(), settled);
  s.rethrow_failure();
  if (!done) {
    throw TimeoutError(fmt::format("{}: {} samples of step {} still have no score at the deadline", scorer_->where(),
                                   s.outstanding, s.step));
  }
  std::vector<std::pair<uint64_t, double>> out;
  out.swap(s.results);
  return out;
}

std::vector<std::pair<uint64_t, double>> BatchedReward::poll() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  s.rethrow_failure();
  std::vector<std::pair<uint64_t, double>> out;
  out.swap(s.results);
  return out;
}

void BatchedReward::flush() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  State::enqueue_pending(state_);
}

void BatchedReward::label_step(uint64_t step) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  s.step = step;
}

RewardStats BatchedReward::take_stats() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  RewardStats out = std::move(s.stats);
  s.stats = RewardStats{};
  return out;
}

}  // namespace tiller::reward
