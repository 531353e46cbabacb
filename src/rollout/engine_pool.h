// The controller's view of the inference engines: one gRPC client per engine, one Generate stream
// per engine per step, least-loaded dispatch, and a single queue that every stream's reader thread
// feeds, so the controller waits on completions from all engines at once. Private to src/rollout.
//
// Threading: the controller's thread calls everything; the reader threads only push to the queue.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tiller/core/deadline.h"
#include "tiller/engine/server.h"

namespace tiller::rollout {

struct Completion {
  int engine = 0;
  engine::ClientResult result;
  std::string failure;  // the stream failed (the engine died or timed out): the job cannot go on
};

class EnginePool {
 public:
  // `addresses[i]` is engine i's host:port.
  EnginePool(std::vector<std::string> addresses, const std::string& token, double rpc_timeout_s);
  ~EnginePool();

  size_t size() const { return clients_.size(); }
  engine::EngineClient& client(size_t i) { return *clients_[i]; }
  const std::string& address(size_t i) const { return addresses_[i]; }

  // Opens one stream per engine that lives until `deadline`, with reader threads.
  void begin(Deadline deadline);
  // Sends `r` (n samples) to the engine with the fewest samples in flight; returns its index.
  int dispatch(const engine::Request& r, uint64_t min_weight_version);
  // Samples in flight on engine i.
  int64_t in_flight(size_t i) const { return in_flight_[i]; }
  int64_t total_in_flight() const;
  // The next completion from any engine, waiting at most `wait_ms`; false when none came.
  bool pop(Completion& out, int wait_ms);
  // Ends the streams (every request must have completed) and joins the readers.
  void end();

 private:
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<engine::EngineClient>> clients_;
  std::vector<std::unique_ptr<engine::GenerateSession>> sessions_;
  std::vector<std::thread> readers_;
  std::vector<int64_t> in_flight_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Completion> queue_;
};

}  // namespace tiller::rollout
