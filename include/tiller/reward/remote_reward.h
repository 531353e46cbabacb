// The client of the remote reward service (proto/tiller/reward.proto), as the scorer of a
// BatchedReward (batched_reward.h): batches leave while generation goes on, several calls at
// once, each with a deadline and retried on transient failures.
//
//   auto remote = std::make_shared<RemoteScorer>(opts);
//   remote->check_health(Deadline::after_seconds(10));  // once, at start: a wrong address fails fast
//   BatchedReward rewards(remote, opts.batch_size, opts.concurrency);
//
// Failures: a call that fails with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED
// is retried up to opts.retries times (backoff 0.5 s, doubling, capped at 8 s). Any other failure
// or retries used up throw CommError naming the address, the step, the status and the server's
// message (the BatchedReward adds wrong counts and scores that are not finite).
//
// Threading: score() from any number of threads at once; check_health() from one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tiller/core/deadline.h"
#include "tiller/reward/batched_reward.h"
#include "tiller/core/tls.h"

namespace tiller::reward {

struct RemoteOptions {
  std::string address;             // host:port
  double timeout_seconds = 60;     // deadline of one Score call
  int retries = 3;                 // retries of a call after a transient failure
  int batch_size = 64;             // samples per call (the BatchedReward's)
  int concurrency = 4;             // calls in flight (the BatchedReward's)
  double backoff_seconds = 0.5;    // first retry's wait (doubles per retry, capped at 8 s)
  std::string token;               // sent as "x-tiller-token" when not empty
  TlsFiles tls;                    // ca (+ server_name): dial TLS
};

class RemoteScorer final : public BatchScorer {
 public:
  explicit RemoteScorer(const RemoteOptions& opts);
  ~RemoteScorer() override;

  // Calls Health; returns the server's name. CommError naming the address when unreachable,
  // ConfigError when it refuses the token.
  std::string check_health(Deadline deadline);
  // One Score call with its retries (BatchScorer).
  BatchScores score(uint64_t step, const std::vector<RewardSample>& samples) override;
  std::string kind() const override { return "remote"; }
  std::string where() const override;

 private:
  void on_cancel() override;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::reward
