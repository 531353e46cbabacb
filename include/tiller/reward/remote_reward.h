// The client of the remote reward service (proto/tiller/reward.proto): the controller hands it
// each sample as it finishes generating; batches leave while generation goes on, several calls
// at once, each with a deadline and retried on transient failures.
//
//   RemoteReward remote(opts);
//   remote.check_health(Deadline::after_seconds(10));   // once, at start: a wrong address fails fast
//   remote.begin_step(step);
//   for each finished sample: remote.add(sample);        // a batch leaves every opts.batch_size
//   for (auto [id, score] : remote.finish(deadline)) ... // flushes, waits for every score
//
// Failures: a call that fails with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED
// is retried up to opts.retries times (backoff 0.5 s, doubling, capped at 8 s). Any other failure,
// retries used up, a wrong number of scores or a score that is not finite make finish() (and
// add(), once known) throw CommError naming the address, the step, the status and the server's
// message; TimeoutError when finish()'s deadline passes first.
//
// Threading: add(), begin_step() and finish() are for one thread (the controller's); calls run
// on opts.concurrency worker threads of the client.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tiller/core/deadline.h"
#include "tiller/core/tls.h"

namespace tiller::reward {

struct RemoteOptions {
  std::string address;             // host:port
  double timeout_seconds = 60;     // deadline of one Score call
  int retries = 3;                 // retries of a call after a transient failure
  int batch_size = 64;             // samples per call
  int concurrency = 4;             // calls in flight
  double backoff_seconds = 0.5;    // first retry's wait (doubles per retry, capped at 8 s)
  std::string token;               // sent as "x-tiller-token" when not empty
  TlsFiles tls;                    // ca (+ server_name): dial TLS
};

struct RemoteSample {
  uint64_t id = 0;                 // the caller's handle; finish() returns it with the score
  std::string prompt, response, label;
  std::string finish_reason;       // "stop" or "length"
  uint64_t prompt_index = 0;       // the prompt's dataset line
  uint32_t sample_index = 0;
  int64_t response_tokens = 0;
};

struct RemoteStats {
  int64_t calls = 0;               // Score calls that succeeded
  int64_t retries = 0;             // attempts that failed transiently and were sent again
  double call_seconds = 0;         // summed wall time of the successful calls
};

class RemoteReward {
 public:
  explicit RemoteReward(const RemoteOptions& opts);
  ~RemoteReward();  // waits for calls in flight (each has its own deadline)
  RemoteReward(const RemoteReward&) = delete;
  RemoteReward& operator=(const RemoteReward&) = delete;

  // Calls Health; returns the server's name. CommError naming the address when unreachable.
  std::string check_health(Deadline deadline);
  // Starts a step: scores from an earlier step that were never collected are dropped.
  void begin_step(uint64_t step);
  // Queues a sample; a full batch is sent at once. Throws the first failure already known.
  void add(RemoteSample s);
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
  RemoteStats take_stats();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::reward
