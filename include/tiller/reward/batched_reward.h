// Rewards scored in batches off the controller's thread: the remote service (remote_reward.h) and
// Python functions in-process (python_reward.h) are two BatchScorers behind one BatchedReward.
//
// The controller hands each sample to add() as it finishes generating; a batch leaves every
// `batch_size` samples (or at flush()), and `concurrency` worker threads each score one batch at
// a time while generation goes on. Results are gathered per step:
//
//   BatchedReward rewards(std::make_shared<RemoteScorer>(opts), opts.batch_size, opts.concurrency);
//   rewards.begin_step(step);
//   for each finished sample: rewards.add(sample);
//   for (auto [id, score] : rewards.finish(deadline)) ...  // flushes, waits for every score
//
// Failures: the first exception a scorer throws for a batch of this step is rethrown, as thrown,
// by the next add(), poll() or finish(); so is a CommError for a wrong number of scores or a score
// that is not finite (naming the sample). finish() throws TimeoutError when its deadline passes
// first. A scorer's message is already one line that names the scorer, the step and the sample.
//
// Threading: add(), begin_step(), finish(), poll(), flush(), label_step() and take_stats() are for
// one thread (the controller's); BatchScorer::score runs on the worker threads, several at once
// when concurrency > 1.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tiller/core/deadline.h"

namespace tiller::reward {

// One finished sample, as a scorer sees it.
struct RewardSample {
  uint64_t id = 0;                 // the caller's handle; finish() returns it with the score
  std::string prompt, response, label;
  bool label_is_json = false;      // the dataset's label was a list, an object or a number (JSON text)
  std::string data_source;         // the dataset's data.data_source_key ("" when it has none)
  std::string extra_info;          // the dataset's data.extra_info_key as JSON text ("" when none)
  std::string finish_reason;       // "stop" or "length"
  uint64_t prompt_index = 0;       // the prompt's dataset line (JSONL) or row (parquet), 1-based
  uint32_t sample_index = 0;
  int64_t response_tokens = 0;
};

// What a scorer answers for one batch.
struct BatchScores {
  std::vector<double> scores;      // one per sample, in order, finite
  int64_t retries = 0;             // attempts that failed transiently before this answer
  // Named extra values the scorer returned beside the scores (verl's reward_extra_info): summed
  // over the batch's samples, with how many samples carried each.
  std::map<std::string, std::pair<double, int64_t>> extras;
};

class BatchScorer {
 public:
  virtual ~BatchScorer() = default;
  // Scores `samples` of PPO step `step`, or throws (CommError, TimeoutError, ...) with one line.
  // Called from worker threads; several calls at once when the BatchedReward's concurrency > 1.
  virtual BatchScores score(uint64_t step, const std::vector<RewardSample>& samples) = 0;
  // Short name for metrics: "remote", "python".
  virtual std::string kind() const = 0;
  // What errors name first: "remote reward HOST:PORT (reward.remote_address)".
  virtual std::string where() const = 0;
  // Makes calls in flight return soon (the BatchedReward's destructor calls it); backoff() returns
  // false from then on.
  void cancel();
  bool cancelled() const;

 protected:
  // What the scorer itself does on cancel() (cancel its RPCs, interrupt its functions).
  virtual void on_cancel() {}
  // Sleeps `seconds` between retries; false when cancel() came first or comes meanwhile.
  bool backoff(double seconds);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool cancelled_ = false;
};

struct RewardStats {
  int64_t calls = 0;               // batches scored
  int64_t retries = 0;             // attempts that failed transiently and were sent again
  double call_seconds = 0;         // summed wall time of the scored batches
  std::map<std::string, std::pair<double, int64_t>> extras;  // (sum, samples) per name
};

class BatchedReward {
 public:
  // Limits: batch_size and concurrency in [1, 4096].
  BatchedReward(std::shared_ptr<BatchScorer> scorer, int batch_size, int concurrency);
  // Cancels the scorer's calls in flight and waits up to a few seconds for the workers; a worker
  // still inside a call after that (a Python function blocked in C code) is left running, so
  // that shutting down never hangs.
  ~BatchedReward();
  BatchedReward(const BatchedReward&) = delete;
  BatchedReward& operator=(const BatchedReward&) = delete;

  BatchScorer& scorer() { return *scorer_; }
  // Starts a step: scores from an earlier step that were never collected are dropped.
  void begin_step(uint64_t step);
  // Queues a sample; a full batch is sent at once. Throws the first failure already known.
  void add(RewardSample s);
  // Sends what is queued and waits for every sample's score: (id, score) in no set order.
  std::vector<std::pair<uint64_t, double>> finish(Deadline deadline);
  // Without waiting: the scores that have come back since the last call (the asynchronous
  // pipeline's way, with flush()). Throws the first failure already known.
  std::vector<std::pair<uint64_t, double>> poll();
  // Sends the batch being filled now, however small.
  void flush();
  // Names `step` in errors from now on, dropping nothing (begin_step drops what is outstanding).
  void label_step(uint64_t step);
  // Totals since the last call to take_stats().
  RewardStats take_stats();

 private:
  struct State;
  std::shared_ptr<BatchScorer> scorer_;
  std::shared_ptr<State> state_;  // shared with the workers, which may outlive this object
};

}  // namespace tiller::reward
