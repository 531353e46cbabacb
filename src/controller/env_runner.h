// The environment calls of multi-turn rollouts, off the controller's thread (private to
// src/controller): every sample's Start, Step and Close run on a pool of worker threads, each call
// with its deadline (env.timeout_s; a remote environment retries transient failures inside it), and
// the answers come back to the controller's thread through poll(). A failed Start or Step comes
// back as a result with its one-line error (the collector ends the job with it); a failed Close is
// logged and forgotten (the episode's data is complete).
//
// Threading: the controller's thread calls everything; the workers only call the environment
// (which serves different sessions from several threads at once, environment.h). The destructor
// waits a few seconds for calls in progress, then leaves them behind (each ends at its deadline).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tiller/env/environment.h"

namespace tiller::controller {

class EnvRunner {
 public:
  struct Result {
    uint64_t key = 0;        // the caller's, from start()/step()
    bool start = false;      // the answer to a Start (else to a Step)
    env::Observation observation;
    double reward = 0;
    bool done = false;
    double seconds = 0;      // the call's wall time, retries included
    std::string error;       // not empty: the call failed
  };

  // `threads` in [1, 4096].
  EnvRunner(std::shared_ptr<env::Environment> env, int threads, double timeout_s);
  ~EnvRunner();
  EnvRunner(const EnvRunner&) = delete;
  EnvRunner& operator=(const EnvRunner&) = delete;

  void start(uint64_t key, env::EpisodeStart episode);
  void step(uint64_t key, const std::string& session_id, env::Action action);
  // Runs once the session's Start or Step in flight (a group dropped mid-call) has ended, never
  // before or beside it; at once when none is. A call still queued is skipped instead (and a
  // skipped Start opened nothing: no Close follows it).
  void close(const std::string& session_id);
  // The answers that came in since the last poll, in the order they came.
  std::vector<Result> poll();
  // Calls queued or running (closes included).
  size_t busy() const;
  const env::Environment& environment() const { return *env_; }

 private:
  struct State;
  std::shared_ptr<env::Environment> env_;
  std::shared_ptr<State> state_;
};

}  // namespace tiller::controller
