// The client of an environment service (proto/tiller/env.proto): each call with its deadline (the
// earlier of the caller's and timeout_seconds), retried on transient failures.
//
//   RemoteEnvironment env(opts);
//   env.check_health(Deadline::after_seconds(10));  // once, at start: a wrong address fails fast
//   Observation first = env.start(episode, deadline);
//   StepResult r = env.step(episode.session_id, action, deadline);  // until r.done
//   env.close(episode.session_id, deadline);
//
// Failures: a call that fails with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED
// is sent again up to opts.retries times (backoff doubling from opts.backoff_seconds, capped at
// 8 s, never past the caller's deadline), so the service's calls must be idempotent (env.proto).
// Any other status, retries used up, or a reward that is not finite throw CommError naming the
// address, the call, the session and turn, the status and the service's message; TimeoutError
// when the caller's deadline passes first. A refused token is a ConfigError.
//
// Threading: every call from any number of threads at once (gRPC channels are thread-safe).
#pragma once

#include <memory>
#include <string>

#include "tiller/core/tls.h"
#include "tiller/env/environment.h"

namespace tiller::env {

struct RemoteEnvOptions {
  std::string address;             // host:port
  double timeout_seconds = 60;     // deadline of one call
  int retries = 3;
  double backoff_seconds = 0.5;
  std::string token;               // sent as "x-tiller-token" when not empty
  TlsFiles tls;                    // ca (+ server_name): dial TLS
};

class RemoteEnvironment final : public Environment {
 public:
  explicit RemoteEnvironment(const RemoteEnvOptions& opts);
  ~RemoteEnvironment() override;

  // Calls Health; returns the service's name.
  std::string check_health(Deadline deadline);
  Observation start(const EpisodeStart& episode, Deadline deadline) override;
  StepResult step(const std::string& session_id, const Action& action, Deadline deadline) override;
  void close(const std::string& session_id, Deadline deadline) override;
  std::string name() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::env
