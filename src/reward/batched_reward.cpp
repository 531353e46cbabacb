// The batching half of every asynchronous reward: a queue of batches, worker threads that each
// score one batch at a time, and results gathered per step (an epoch number drops the results of
// a step that was abandoned). The state is shared with the workers, so that a worker stuck in a
// call can be left behind at shutdown without touching freed memory.
#include "tiller/reward/batched_reward.h"

#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
#include <thread>

#include <fmt/format.h>

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
  std::condition_variable cv;          // queue changes, results, stopping, workers leaving
  std::deque<Batch> queue;
  Batch pending;                        // the batch being filled
  uint64_t epoch = 0, step = 0;
  int64_t outstanding = 0;              // samples of this epoch sent (or queued) and not yet scored
  std::vector<std::pair<uint64_t, double>> results;
  std::exception_ptr failure;           // the first failure of this epoch
  RewardStats stats;
  bool stopping = false;
  int running = 0;                      // workers that have not returned

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

  void work() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) break;
      Batch b = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
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
      lock.lock();
      if (b.epoch != epoch) continue;  // a step that was abandoned
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
    --running;
    cv.notify_all();
  }

  void enqueue_pending() {  // under mu
    if (pending.samples.empty()) return;
    pending.epoch = epoch;
    pending.step = step;
    queue.push_back(std::move(pending));
    pending = Batch{};
    cv.notify_all();
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
  state_->running = concurrency;
  for (int i = 0; i < concurrency; ++i) {
    std::thread([s = state_] { s->work(); }).detach();
  }
}

BatchedReward::~BatchedReward() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
  }
  s.cv.notify_all();
  scorer_->cancel();
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.cv.wait_for(lock, std::chrono::duration<double>(kShutdownGraceSeconds), [&] { return s.running == 0; }))
    log::warn("{}: {} scoring call(s) still running {} s after shutdown began; left behind", scorer_->where(),
              s.running, kShutdownGraceSeconds);
}

void BatchedReward::begin_step(uint64_t step) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.epoch;
  s.step = step;
  s.queue.clear();
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
  if (static_cast<int>(s.pending.samples.size()) >= s.batch_size) s.enqueue_pending();
}

std::vector<std::pair<uint64_t, double>> BatchedReward::finish(Deadline deadline) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  s.enqueue_pending();
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
  s.enqueue_pending();
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
